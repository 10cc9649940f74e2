#!/usr/bin/env python3
"""File- and folder-level import cycles in the workspace's Rust crates.

For every crate (each `Cargo.toml` with a `src/lib.rs` or `src/main.rs` under `crates/`,
`xtask/`, `tests/`, `benches/`), builds the module tree from `mod name;` declarations and
inline `mod name { ... }` blocks, then a graph with one node per source file: an edge
`A -> B` when code in file A names an item of file B through a `crate::`, `super::` or
`self::` path (in a `use` or inline), or through a child-module-relative `use`.

Rules:
- A `pub use` / `pub(crate) use` re-export is an alias, not an edge: a path through it
  counts as a reference to the file that defines the item (so a facade `mod.rs` that only
  declares and re-exports its children is not part of a cycle with them).
- `mod x;` declarations are ownership, not edges.
- Test code is left out by default: `#[cfg(test)]` items (inline `mod tests { ... }` blocks,
  `#[cfg(test)] mod x;` files, `#[cfg(test)] use`). `--include-tests` keeps it.
- Comments and string literals are ignored.

Folders: the same edges lifted to the folders (modules that are directories) of a crate. For an
edge between two files, the two sides are the entries (a folder, or a file) just below the
deepest directory that holds both; `foo.rs` with a `foo/` directory counts as part of folder
`foo/`. A strongly connected component of those entries that holds at least one folder is a
folder-level cycle (one of files only is a file-level cycle, reported above it). So
`model/ -> weights/ -> model/` is a cycle even when no two files import each other.

Prints each crate's cycles (strongly connected components with more than one file or folder,
with the edges inside them and one reference per edge), or `no cycles`. Exit status 1 when a
crate named with `--require-acyclic CRATE` (repeatable, or `all`) has a cycle of either kind.

Python 3 standard library only. Usage:
    tools/check_import_cycles.py [--include-tests] [--require-acyclic deltafin-k3] [ROOT]
"""

import argparse
import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text):
    """Blank out comments, strings and char literals, keeping offsets and newlines."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c in "rb" and re.match(r"(?:br|r)#*\"", text[i:i + 260]) and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            m = re.match(r"(?:br|r)(#*)\"", text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            blank(i, end)
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            m = re.match(r"'(?:\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'", text[i:])
            if m:
                blank(i, i + m.end())
                i += m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def matching_brace(code, open_at):
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(code) - 1


ATTRS = r"(?P<attrs>(?:#\s*\[[^\]]*(?:\[[^\]]*\][^\]]*)*\]\s*)*)"
MOD_RE = re.compile(ATTRS + r"(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(?P<name>" + IDENT + r")\s*(?P<end>[;{])")
USE_RE = re.compile(ATTRS + r"(?P<pub>pub(?:\s*\([^)]*\))?\s+)?use\s+(?P<tree>[^;]+);")
PATH_RE = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)")


def is_test_attrs(attrs):
    return re.search(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", attrs or "") is not None


def expand_use_tree(tree):
    """`a::{b, c::{d, self}, e as f}` -> [(['a','b'], 'b'), (['a','c','d'], 'd'), ...]."""
    tree = re.sub(r"\s+", " ", tree.strip())
    out = []

    def parse(s, prefix):
        s = s.strip()
        if not s:
            return
        # split top-level on the first '{'
        depth, brace = 0, -1
        for k, ch in enumerate(s):
            if ch == "{" and depth == 0:
                brace = k
                break
        if brace < 0:
            m = re.match(r"(.*?)(?:\s+as\s+(" + IDENT + r"))?$", s)
            path = [p.strip() for p in m.group(1).split("::") if p.strip()]
            full = prefix + path
            if full and full[-1] == "self":
                full = full[:-1]
            name = m.group(2) or (full[-1] if full else "")
            out.append((full, name))
            return
        head = [p.strip() for p in s[:brace].split("::") if p.strip()]
        inner = s[brace + 1:s.rindex("}")]
        parts, depth, cur = [], 0, ""
        for ch in inner:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        for p in parts:
            parse(p, prefix + head)

    parse(tree, [])
    return out


class Crate:
    def __init__(self, name, root_file, include_tests):
        self.name = name
        self.include_tests = include_tests
        self.files = {}  # path -> stripped code
        self.children = {}  # module path tuple -> {name: module path tuple}
        self.file_of = {}  # module path tuple -> file
        self.uses = {}  # file -> [(module path, path segments, is_pub, alias name, where)]
        self.aliases = {}  # module path tuple -> {name: absolute path list}
        self.globs = {}  # module path tuple -> [absolute module path list]
        self.refs = []  # (file, module path, segments, where)
        self.load(root_file, ())

    def load(self, path, modpath):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return
        code = strip_code(text)
        self.files[path] = code
        # Inline module spans and test blocks.
        spans = []  # (start, end, name, is_test)
        for m in MOD_RE.finditer(code):
            if m.group("end") == "{":
                open_at = m.end() - 1
                spans.append((m.start(), matching_brace(code, open_at), m.group("name"),
                              is_test_attrs(m.group("attrs")), m))
        skipped = [(a, b) for (a, b, _, t, _) in spans if t and not self.include_tests]

        def in_skipped(pos):
            return any(a <= pos <= b for a, b in skipped)

        def module_at(pos):
            mp = list(modpath)
            for a, b, name, _, m in sorted(spans, key=lambda s: s[0]):
                if m.end() <= pos <= b:
                    mp.append(name)
            return tuple(mp)

        self.file_of.setdefault(modpath, path)
        for a, b, name, t, m in spans:
            if in_skipped(m.start()):
                continue
            mp = module_at(m.start()) + (name,)
            self.children.setdefault(mp[:-1], {})[name] = mp
            self.file_of[mp] = path
        # Out-of-line modules.
        base = os.path.basename(path)
        if base in ("mod.rs", "lib.rs", "main.rs"):
            mod_dir = os.path.dirname(path)
        else:
            mod_dir = os.path.join(os.path.dirname(path), base[:-3])
        for m in MOD_RE.finditer(code):
            if m.group("end") != ";" or in_skipped(m.start()):
                continue
            if is_test_attrs(m.group("attrs")) and not self.include_tests:
                continue
            inner = module_at(m.start())
            sub = os.path.join(mod_dir, *inner[len(modpath):])
            name = m.group("name")
            mp = inner + (name,)
            self.children.setdefault(inner, {})[name] = mp
            cand = [os.path.join(sub, name + ".rs"), os.path.join(sub, name, "mod.rs")]
            pm = re.search(r'#\s*\[\s*path\s*=', m.group("attrs") or "")
            if pm:
                raw = text[m.start():m.end()]
                q = re.search(r'path\s*=\s*"([^"]+)"', raw)
                if q:
                    cand = [os.path.join(os.path.dirname(path), q.group(1))]
            for c in cand:
                if os.path.exists(c):
                    self.load(c, mp)
                    break
        # Uses.
        use_spans = []
        for m in USE_RE.finditer(code):
            use_spans.append((m.start(), m.end()))
            if in_skipped(m.start()):
                continue
            if is_test_attrs(m.group("attrs")) and not self.include_tests:
                continue
            here = module_at(m.start())
            line = code.count("\n", 0, m.start()) + 1
            for segs, name in expand_use_tree(m.group("tree")):
                if not segs:
                    continue
                if segs[-1] == "*":
                    if m.group("pub"):
                        self.globs.setdefault(here, []).append((here, segs[:-1]))
                    else:
                        self.refs.append((path, here, segs[:-1], line))
                    continue
                if m.group("pub"):
                    self.aliases.setdefault(here, {})[name] = (here, segs)
                else:
                    self.refs.append((path, here, segs, line))
        for m in PATH_RE.finditer(code):
            if in_skipped(m.start()) or any(a <= m.start() < b for a, b in use_spans):
                continue
            here = module_at(m.start())
            segs = [s.strip() for s in m.group(1).split("::")]
            line = code.count("\n", 0, m.start()) + 1
            self.refs.append((path, here, segs, line))

    def absolute(self, here, segs):
        """Turn a path as written in module `here` into an absolute module path list, or
        None for an external crate."""
        segs = list(segs)
        if not segs:
            return None
        if segs[0] == "crate":
            cur, rest = (), segs[1:]
        elif segs[0] in ("super", "self"):
            cur, rest = here, segs
            while rest and rest[0] in ("super", "self"):
                if rest[0] == "super":
                    cur = cur[:-1]
                rest = rest[1:]
        elif segs[0] in self.children.get(here, {}) or segs[0] in self.aliases.get(here, {}):
            cur, rest = here, segs
        else:
            return None
        return list(cur) + rest

    def resolve(self, here, segs, depth=0):
        """The file that defines what `segs` (written in module `here`) names."""
        path = self.absolute(here, segs)
        if path is None or depth > 16:
            return None
        cur = ()
        for k, seg in enumerate(path):
            kids = self.children.get(cur, {})
            if seg in kids:
                cur = kids[seg]
                continue
            al = self.aliases.get(cur, {})
            if seg in al:
                ahere, asegs = al[seg]
                return self.resolve(ahere, list(asegs) + path[k + 1:], depth + 1) or self.file_of.get(cur)
            for ghere, gsegs in self.globs.get(cur, []):
                target = self.absolute(ghere, gsegs)
                if target is not None:
                    r = self.resolve((), ["crate"] + target + path[k:], depth + 1)
                    if r and r != self.file_of.get(tuple(target)):
                        return r
            break
        return self.file_of.get(cur)

    def graph(self):
        edges = {}
        for f, here, segs, line in self.refs:
            t = self.resolve(here, segs)
            if t and t != f:
                edges.setdefault(f, {}).setdefault(t, (line, "::".join(segs)))
        return edges


def sccs(nodes, edges):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def unit_path(src, path):
    """`path` relative to `src` as components, `foo.rs` beside a `foo/` directory as
    `foo/mod.rs`, so that a module and its folder are one entry."""
    parts = os.path.relpath(path, src).split(os.sep)
    if parts[-1] not in ("mod.rs", "lib.rs", "main.rs") and os.path.isdir(path[:-3]):
        parts = parts[:-1] + [parts[-1][:-3], "mod.rs"]
    return parts


def folder_cycles(src, files, edges):
    """Cycles between sibling entries (folders or files) below a common directory, keeping
    those with at least one folder. Returns [(level, [entry], [(a, b, file, line, what)])]."""
    levels = {}  # directory tuple -> {entry: {entry: (file, line, what)}}
    nodes = {}
    for f in files:
        u = unit_path(src, f)
        for k in range(len(u)):
            nodes.setdefault(tuple(u[:k]), set()).add(u[k] + ("/" if k < len(u) - 1 else ""))
    for f, targets in edges.items():
        a = unit_path(src, f)
        for t, (line, what) in targets.items():
            b = unit_path(src, t)
            k = 0
            while k < min(len(a), len(b)) - 1 and a[k] == b[k]:
                k += 1
            na = a[k] + ("/" if k < len(a) - 1 else "")
            nb = b[k] + ("/" if k < len(b) - 1 else "")
            if na == nb:
                continue
            lv = levels.setdefault(tuple(a[:k]), {})
            lv.setdefault(na, {}).setdefault(nb, (f, line, what))
    out = []
    for level in sorted(levels):
        lv = levels[level]
        for comp in sccs(nodes.get(level, set()), lv):
            if not any(n.endswith("/") for n in comp):
                continue
            inner = [(a, b) + lv[a][b] for a in comp for b in sorted(lv.get(a, {})) if b in comp]
            out.append((level, comp, inner))
    return out


def crates(root):
    for top in ("crates", "xtask", "tests", "benches"):
        d = os.path.join(root, top)
        dirs = [d] if os.path.exists(os.path.join(d, "Cargo.toml")) else (
            [os.path.join(d, x) for x in sorted(os.listdir(d))] if os.path.isdir(d) else [])
        for c in dirs:
            toml = os.path.join(c, "Cargo.toml")
            if not os.path.exists(toml):
                continue
            with open(toml, encoding="utf-8") as f:
                m = re.search(r'^name\s*=\s*"([^"]+)"', f.read(), re.M)
            name = m.group(1) if m else os.path.basename(c)
            for target in ("src/lib.rs", "src/main.rs"):
                p = os.path.join(c, target)
                if os.path.exists(p):
                    yield name + ("" if target == "src/lib.rs" else " (bin)"), p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--include-tests", action="store_true")
    ap.add_argument("--require-acyclic", action="append", default=[])
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    failed = False
    for name, lib in crates(root):
        c = Crate(name, lib, a.include_tests)
        edges = c.graph()
        cyc = sccs(c.files.keys(), edges)
        src = os.path.dirname(lib)
        fcyc = folder_cycles(src, c.files.keys(), edges)
        rel = lambda p: os.path.relpath(p, src)
        if not cyc and not fcyc:
            print(f"{name}: no cycles ({len(c.files)} files)")
            continue
        print(f"{name}: {len(cyc)} file cycle(s), {len(fcyc)} folder cycle(s)")
        for comp in cyc:
            print("  cycle: " + ", ".join(rel(f) for f in comp))
            for f in comp:
                for t, (line, what) in sorted(edges.get(f, {}).items()):
                    if t in comp:
                        print(f"    {rel(f)}:{line} -> {rel(t)}  ({what})")
        for level, comp, inner in fcyc:
            at = "/".join(level) + "/" if level else ""
            print("  folder cycle: " + ", ".join(at + n for n in comp))
            for x, y, f, line, what in inner:
                print(f"    {at}{x} -> {at}{y}  ({rel(f)}:{line} {what})")
        if "all" in a.require_acyclic or name in a.require_acyclic:
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
