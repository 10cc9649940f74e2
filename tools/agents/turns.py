#!/usr/bin/env python3
"""Time each coding agent's first and second turn against `deltafin serve` (docs/AGENTS.md).

    python3 tools/agents/turns.py --model-root DIR [--deltafin target/release/deltafin]
                                  [--agents codex,claude,opencode] [--spine int8|bf16]

Starts `deltafin serve` on DIR, installs nothing (run `npm ci --prefix tools/agents
--ignore-scripts` first), and for each agent runs a first turn in a fresh home ("say hi") and
a second turn that continues the same session ("and again"). For each turn it reads the
server's `/metrics` before and after and prints the prompt tokens the turn's requests carried,
the tokens restored from stored prefix states, the tokens prefilled and the prefill seconds,
and the turn's wall time. The agents are configured exactly as docs/AGENTS.md says, with the
output cut to a few tokens (a synthesized checkpoint's answers are noise: the figure that
matters is the prefill of the agent's system prompt and tools).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = os.path.join(HERE, "node_modules")
BINS = {
    "codex": os.path.join(MODULES, ".bin", "codex"),
    "claude": os.path.join(MODULES, "@anthropic-ai", "claude-code-linux-x64", "claude"),
    "opencode": os.path.join(MODULES, "opencode-linux-x64", "bin", "opencode"),
}
MODEL = "deltafin-kimi-k3"
OUTPUT_TOKENS = 8
COUNTERS = (
    "deltafin_prompt_tokens_total",
    "deltafin_prefix_reused_tokens_total",
    "deltafin_prefill_seconds_total",
    "deltafin_requests_total",
)


def metrics(base):
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def codex_cmd(home, base, prompt, first):
    codex_home = os.path.join(home, ".codex")
    os.makedirs(codex_home, exist_ok=True)
    with open(os.path.join(codex_home, "config.toml"), "w") as f:
        f.write(
            f'model = "{MODEL}"\nmodel_provider = "deltafin"\n\n'
            f'[model_providers.deltafin]\nname = "deltafin"\nbase_url = "{base}/v1"\n'
            'wire_api = "responses"\nstream_idle_timeout_ms = 3600000\n'
        )
    env = {"HOME": home, "CODEX_HOME": codex_home}
    args = ["exec", "--skip-git-repo-check"]
    if not first:
        args += ["resume", "--last"]
    return [BINS["codex"], *args, prompt], env


def claude_cmd(home, base, prompt, first):
    env = {
        "HOME": home,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_MODEL": MODEL,
        "API_TIMEOUT_MS": "3600000",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "262144",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS),
    }
    args = ["-p"] if first else ["-p", "--continue"]
    return [BINS["claude"], *args, "--", prompt], env


def opencode_cmd(home, base, prompt, first):
    config = os.path.join(home, ".config", "opencode")
    os.makedirs(config, exist_ok=True)
    with open(os.path.join(config, "opencode.json"), "w") as f:
        json.dump(
            {
                "$schema": "https://opencode.ai/config.json",
                "provider": {
                    "deltafin": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "deltafin",
                        "options": {"baseURL": base + "/v1", "apiKey": "sk-local", "timeout": False},
                        "models": {
                            MODEL: {
                                "name": "Kimi K3 (deltafin)",
                                "limit": {"context": 262144, "output": OUTPUT_TOKENS},
                            }
                        },
                    }
                },
                "model": "deltafin/" + MODEL,
            },
            f,
        )
    env = {"HOME": home}
    for k, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_DATA_HOME", ".local/share"),
                   ("XDG_CACHE_HOME", ".cache"), ("XDG_STATE_HOME", ".local/state")):
        env[k] = os.path.join(home, sub)
    args = ["run"] if first else ["run", "--continue"]
    return [BINS["opencode"], *args, prompt], env


COMMANDS = {"codex": codex_cmd, "claude": claude_cmd, "opencode": opencode_cmd}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-root", required=True)
    ap.add_argument("--deltafin", default=os.path.join(HERE, "..", "..", "target", "release", "deltafin"))
    ap.add_argument("--agents", default="codex,claude,opencode")
    ap.add_argument("--spine", default="bf16")
    a = ap.parse_args()

    env = dict(os.environ, K3_SPINE=a.spine)
    for k in ("DELTAFIN_API_KEY", "K3_SERVER_QUEUE", "K3_MEMORY_BUDGET_GB"):
        env.pop(k, None)
    state = tempfile.mkdtemp(prefix="deltafin-turns-")
    serve = subprocess.Popen(
        [a.deltafin, "serve", "--port", "0", "--model-root", a.model_root,
         "--max-tokens", str(OUTPUT_TOKENS)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    base = None
    for line in serve.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            base = m.group(1)
            break
    if base is None:
        sys.exit("deltafin serve exited before it listened")
    while True:
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                break
        except Exception:
            time.sleep(1)
    print(f"| agent | turn | requests | prompt tokens | restored | prefilled | prefill s | prefill token/s | turn s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for name in a.agents.split(","):
            home = tempfile.mkdtemp(prefix=f"deltafin-{name}-", dir=state)
            for turn, prompt in ((1, "say hi"), (2, "and again")):
                cmd, extra = COMMANDS[name](home, base, prompt, turn == 1)
                before = metrics(base)
                t0 = time.monotonic()
                p = subprocess.run(cmd, env=dict(os.environ, **extra), cwd=home,
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                   timeout=3600)
                wall = time.monotonic() - t0
                after = metrics(base)
                d = {k: after[k] - before[k] for k in COUNTERS}
                prefilled = d["deltafin_prompt_tokens_total"] - d["deltafin_prefix_reused_tokens_total"]
                rate = prefilled / d["deltafin_prefill_seconds_total"] if d["deltafin_prefill_seconds_total"] else 0
                status = "" if p.returncode == 0 else f" (exit {p.returncode}: {p.stderr.strip()[-200:]!r})"
                print(f"| {name} | {turn} | {d['deltafin_requests_total']:.0f} | "
                      f"{d['deltafin_prompt_tokens_total']:.0f} | {d['deltafin_prefix_reused_tokens_total']:.0f} | "
                      f"{prefilled:.0f} | {d['deltafin_prefill_seconds_total']:.1f} | {rate:.1f} | {wall:.1f}{status} |",
                      flush=True)
    finally:
        serve.terminate()
        serve.wait()


if __name__ == "__main__":
    main()
