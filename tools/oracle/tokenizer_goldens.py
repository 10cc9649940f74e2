#!/usr/bin/env python3
"""Golden ids for the Kimi K3 tokenizer (spec §7), from Python tiktoken 0.14.0.

Reproduces Moonshot's `TikTokenTokenizer` wrapper (tokenization_kimi.py; identical to
nemo-automodel 0.7.0 components/models/kimi_k3/tokenization.py) without transformers:
the verbatim §7.3 regex, 256 specials named from tokenizer_config.json, the 400,000-char
slices and the 25,000-char whitespace/non-whitespace run rule with `str.isspace`, and
`allowed_special="all"` (allow_special=True) vs `disallowed_special=()` (False).

Writes tests/fixtures/tokenizer/goldens.json. A case is
  {"text": str, "allow_special": bool, "ids": [...]}
or, for long inputs, {"parts": [{"repeat": str, "count": int}, ...], ...}: the text is the
concatenation of each `repeat` repeated `count` times.

Usage: python tools/oracle/tokenizer_goldens.py [--assets assets/kimi] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

assert tiktoken.__version__ == "0.14.0", tiktoken.__version__

ROOT = Path(__file__).resolve().parents[2]

# Verbatim from tokenization_kimi.py (`chr(38) * 2` there is the `&&` written here).
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


class KimiTokenizer:
    """The encode path of Moonshot's TikTokenTokenizer, line for line."""

    def __init__(self, assets: Path):
        ranks = load_tiktoken_bpe(str(assets / "tiktoken.model"))
        config = json.loads((assets / "tokenizer_config.json").read_text())
        mapping = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
        n = len(ranks)
        self.special_tokens = {
            mapping.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)
        }
        self.model = tiktoken.Encoding(
            name="kimi-k3", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )

    @staticmethod
    def _split_whitespaces_or_nonwhitespaces(s: str, max_consecutive_slice_len: int):
        current_slice_len = 0
        current_slice_is_space = s[0].isspace() if len(s) > 0 else False
        slice_start = 0
        for i in range(len(s)):
            is_now_space = s[i].isspace()
            if current_slice_is_space ^ is_now_space:
                current_slice_len = 1
                current_slice_is_space = is_now_space
            else:
                current_slice_len += 1
                if current_slice_len > max_consecutive_slice_len:
                    yield s[slice_start:i]
                    slice_start = i
                    current_slice_len = 1
        yield s[slice_start:]

    def encode(self, text: str, allow_special_tokens: bool = True) -> list[int]:
        t: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for substr in self._split_whitespaces_or_nonwhitespaces(
                text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
            ):
                if allow_special_tokens:
                    t.extend(self.model.encode(substr, allowed_special="all"))
                else:
                    t.extend(self.model.encode(substr, disallowed_special=()))
        return t

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(ids)


HAND_WRITTEN = [
    # prose
    "Hello world",
    "Hello, world!",
    "The capital of France is",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "  leading spaces and trailing spaces  ",
    "",
    " ",
    "a",
    "A",
    "?",
    "\n",
    # contractions, mixed case
    "don't can't won't I'm you're we've they'll she'd it's",
    "DON'T CAN'T I'M YOU'RE WE'VE THEY'LL SHE'D IT'S",
    "We'Re They'Ll He'S I'D You'Ve",
    "rock'n'roll o'clock y'all",
    "'s 't 're",
    "John's book isn't Mary's",
    "camelCaseIdentifier PascalCase snake_case SCREAMING_CASE kebab-case",
    "HTTPServerError XMLHttpRequest iPhone eBay McDonald",
    # numbers
    "1 12 123 1234 12345 123456 1234567",
    "3.14159 2.71828 -42 +7 1e10 0x1F 0b1010 1_000_000",
    "Price: $1,234.56 (or €1.234,56) on 2024-01-31 at 23:59:59",
    "٣٤٥ १२३ ௧௨௩ ①②③ ½ ¾ Ⅻ",
    # whitespace runs
    "a  b   c    d     e",
    "tab\tseparated\tvalues\t\tdouble",
    "\t\t\tindented with tabs",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    "mixed\r\n\n\r\r\nbreaks",
    "trailing spaces   \nnext",
    "   \n   \n   ",
    "nbsp\u00a0between\u00a0\u00a0words",
    "file\u001cgroup\u001drecord\u001eunit\u001fsep",
    "line\u2028separator\u2029paragraph",
    "ideographic\u3000space\u3000\u3000here",
    "thin\u2009space en\u2002space em\u2003space narrow\u202fnbsp",
    "vertical\u000btab\u000cformfeed\u0085nel",
    "zero\u200bwidth\u200cjoiner\u200dtext\ufeffbom",
    "ogham\u1680space medium\u205fmath",
    " \t \u00a0 \u3000 x",
    "x \t \u00a0 \u3000",
    "    def f(x):\n        return x\n",
    # code
    "fn main() {\n    println!(\"Hello, world!\");\n}\n",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<div class=\"container\"><p>Hello &amp; welcome</p></div>",
    "#include <stdio.h>\nint main(void) { return 0; }",
    "x => x * 2; a ?? b; c?.d; e !== f; g >>>= 1;",
    "https://example.com/path?query=1&other=two#fragment",
    "user@example.com, first.last+tag@sub.domain.org",
    "// comment\n/* block */\n# hash\n-- sql\n",
    "$ ls -la | grep '^d' > dirs.txt 2>&1",
    "^[a-zA-Z0-9_]+$ \\d+\\.\\d* (?i:abc)",
    # CJK
    "你好世界",
    "我爱北京天安门。今天天气很好！",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다. 안녕하세요!",
    "中文English混合text测试123",
    "漢字かな交じり文",
    "（全角括号）「引用」『二重』【強調】",
    # emoji
    "😀😃😄😁",
    "family: 👨\u200d👩\u200d👧\u200d👦 flag: 🇫🇷 🇯🇵 skin: 👍🏽",
    "🦀 Rust 🐍 Python ☕ Java",
    "❤️ ✨ ⭐ 🔥💯",
    # RTL
    "مرحبا بالعالم",
    "שלום עולם",
    "English then العربية then English",
    "\u202eright-to-left override\u202c",
    # combining marks, Indic, Thai
    "e\u0301 a\u0308 n\u0303 c\u0327",
    "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "தமிழ் বাংলা ગુજરાતી",
    "Ελληνικά Русский язык Українська",
    "Ａｂｃ ＡＢＣ ａｂｃ",
    "ǅemal ǈubljana ǋunja",
    "ß ẞ ﬁ ﬂ Ǳ",
    # special spellings
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "[BOS]",
    "[EOS]",
    "a <|open|> b [BOS] c",
    "<|reserved_token_163700|>",
    "<|reserved_token_163837|>",
    "<|reserved_token_99|>",
    "<|open|>message role=\"user\"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>",
    "<|open|><|close|><|sep|>",
    "<|open|",
    "|open|>",
    "<<|open|>>",
    "[start_header_id]system[end_header_id]",
    "<osagent_mode>on</osagent_mode>",
    "<|media_begin|><|media_content|><|media_pad|><|media_end|>",
    "[UNK][PAD][EOT]",
    "<|im_end|> <|im_user|>",
    # punctuation runs
    "!!!???...,,,;;;:::",
    "--- *** ___ === +++ ~~~",
    "...\n\n...",
    "\"quoted\" 'single' `back`",
    "(a)[b]{c}<d>",
    "a\u00adb soft hyphen",
    "\x00\x01\x02 control \x7f",
    "\u0000null",
    "\U0001F600\U0001F4A9\U0001FAE0",
    "\U00010348 gothic \U0001D11E music",
]

FRAGMENTS = [
    "Hello", " world", "The", " quick", " brown", " fox", "DON'T", "We'Re", "it's", " I'M", "'ll",
    "0", "7", "42", "123", "4567", "3.14", "1,000", "-1", "2024",
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u001c", "\u001f", "\u2028",
    "\u3000", "\u2003", "\u0085", "\u000b",
    ".", ",", "!", "?", "...", "()", "{}", "[]", "<>", "=>", "::", "//", "#", "@", "&", "\"", "'", "`",
    "fn", " main", "()", " {", "}", "def", " return", " x", " +", " y", ";", "_", "__init__", "self.",
    "你好", "世界", "中文", "日本", "한국어", "テスト", "。", "，",
    "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "❤️", "🦀",
    "مرحبا", "שלום", "नमस्ते", "สวัสดี", "e\u0301", "n\u0303", "Ω", "ß", "ǅ", "Ａ",
    "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "[EOS]", "<|reserved_token_163700|>",
    "<|", "|>", "[", "]", "<osagent_mode>",
    "camelCase", "HTTPServer", "snake_case", "XMLHttp", "iPhone",
]

LONG_CASES = [
    [{"repeat": " ", "count": 25_001}],
    [{"repeat": " ", "count": 25_000}],
    [{"repeat": " ", "count": 50_001}, {"repeat": "x", "count": 1}],
    [{"repeat": "abc", "count": 8334}],
    [{"repeat": "a", "count": 25_000}],
    [{"repeat": "a", "count": 25_001}],
    [{"repeat": "\t", "count": 24_999}, {"repeat": "\u001c", "count": 3}, {"repeat": "z", "count": 2}],
    [{"repeat": "\u00a0", "count": 25_003}, {"repeat": "end", "count": 1}],
    # One separator between two 24,990-char words: only if it counts as whitespace
    # (str.isspace) does the text stay one piece; otherwise the 25,000 rule cuts the words.
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u001c", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u001f", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u0085", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u2028", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u3000", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u200b", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "a", "count": 24_990}, {"repeat": "\u180e", "count": 1}, {"repeat": "b", "count": 24_990}],
    [{"repeat": "word ", "count": 6000}, {"repeat": "x", "count": 30_000}, {"repeat": " tail", "count": 1}],
    [{"repeat": "你好世界", "count": 6500}],
    [{"repeat": "😀", "count": 25_002}],
    [{"repeat": "The quick brown fox jumps over the lazy dog. ", "count": 700}],
    [{"repeat": "x", "count": 24_998}, {"repeat": "<|open|>", "count": 1}, {"repeat": "y", "count": 5}],
    # a 400,000-character slice boundary inside a word ("hell|o world")
    [{"repeat": "hello world ", "count": 34_000}],
    # a 400,000-character slice boundary inside a special spelling
    [{"repeat": " ", "count": 399_996}, {"repeat": "<|open|>tail", "count": 1}],
]


def expand(parts: list[dict]) -> str:
    return "".join(p["repeat"] * p["count"] for p in parts)


def random_texts(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        n = rng.randint(1, 24)
        out.append("".join(rng.choice(FRAGMENTS) for _ in range(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", type=Path, default=ROOT / "assets" / "kimi")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "tokenizer" / "goldens.json")
    args = ap.parse_args()
    tok = KimiTokenizer(args.assets)

    # Known values (SOURCES.md, spec §7.6).
    known = {
        "Hello world": [19180, 2695],
        "你好世界": [33845, 2243],
        "Hello, world!": [19180, 11, 2695, 0],
        "The capital of France is": [1008, 10484, 318, 15383, 387],
    }
    for text, ids in known.items():
        assert tok.encode(text, False) == ids, (text, tok.encode(text, False))
        assert tok.encode(text, True) == ids, text
    assert tok.encode("<|open|>", False) == [27, 91, 4454, 91, 29]
    assert tok.encode("<|open|>", True) == [163587]
    assert tok.model.n_vocab == 163_840
    xtml_ranks = {
        "message": 2778, " role": 6244, '="': 878, "user": 2482, '"': 1, "assistant": 69702,
        "response": 12092, "think": 39964, "system": 14062, " type": 1798, "tool": 20960,
        " tool": 4453, " index": 4002, "Hello": 19180, " world": 2695,
    }
    for text, rank in xtml_ranks.items():
        assert tok.encode(text, False) == [rank], (text, tok.encode(text, False))
    # Long runs differ from one plain tiktoken call (the reason for the wrapper).
    spaces = " " * 25_001
    assert tok.encode(spaces, False) != tok.model.encode(spaces, disallowed_special=())

    cases = []
    for text in HAND_WRITTEN:
        for allow in (False, True):
            cases.append({"text": text, "allow_special": allow, "ids": tok.encode(text, allow)})
    rng = random.Random(20260731)
    for text in random_texts(rng, 260):
        allow = rng.random() < 0.5
        cases.append({"text": text, "allow_special": allow, "ids": tok.encode(text, allow)})
    for n, parts in enumerate(LONG_CASES):
        text = expand(parts)
        assert len(text) > 24_000
        # Both modes where a special is spelled; otherwise alternate to keep the fixture small.
        modes = (False, True) if "<|" in text else ((False,) if n % 2 == 0 else (True,))
        for allow in modes:
            ids = tok.encode(text, allow)
            assert tok.decode(ids) == text
            cases.append({"parts": parts, "allow_special": allow, "ids": ids})

    doc = {
        "generator": "tools/oracle/tokenizer_goldens.py",
        "oracle": f"tiktoken {tiktoken.__version__} with Moonshot's TikTokenTokenizer wrapper",
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {len(cases)} cases to {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
