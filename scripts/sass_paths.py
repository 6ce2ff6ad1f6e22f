#!/usr/bin/env python3
"""Loops of a kernel's SASS and what one trip through each executes: how many instructions a step of
a main loop issues, not just how many the cubin holds (a second copy of a step that only some trips
take adds to the static count, not to the executed one).

    python scripts/sass_paths.py cubin_or_nvdisasm_text [...]         # files (.cubin or nvdisasm -c text)
    python scripts/sass_paths.py --bwd d=128 --bwd d=128,causal=true   # our backward, compiled (sass_report spec)

For every loop (a backward branch; the outermost first) it prints the static size of the loop body and,
over the acyclic paths from the loop's head back to its branch (inner loops, e.g. mbarrier retry loops,
contribute their first trip), each distinct (instructions, MUFU.EX2, HGMMA, FSEL, BAR) tuple with how
many paths give it. A path that leaves the loop (EXIT, or a branch past its end) is not a trip.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
# What a path's tuple counts: opcode prefixes.
COUNTED = ("MUFU.EX2", "HGMMA", "FSEL", "BAR")


def parse(text: str) -> list[dict]:
    """Instructions of the first kernel in nvdisasm -c text: address, opcode, guard, branch target."""
    out, labels, pending = [], {}, []
    for line in text.splitlines():
        if line.startswith("//") and "//-" in line[:4] and out:
            break  # the next kernel's banner
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _LINE.match(line)
        if not m:
            continue
        body = m.group(2)
        guard = body.split()[0] if body.startswith("@") else None
        op = body.split()[1 if guard else 0]
        target = _TARGET.search(body)
        for label in pending:
            labels[label] = len(out)
        pending = []
        out.append(dict(op=op, guard=guard, target=target.group(1) if target else None))
    for inst in out:
        inst["to"] = labels.get(inst["target"]) if inst["target"] else None
    return out


def successors(code: list[dict], i: int) -> list[int]:
    inst = code[i]
    op = inst["op"]
    if op.startswith(("EXIT", "RET")):
        return [i + 1] if inst["guard"] else []
    if op.startswith(("BRA", "JMP")) and inst["to"] is not None:
        return [inst["to"]] + ([i + 1] if inst["guard"] or op.startswith("BRA.U.ANY") else [])
    if op.startswith(("BRX", "JMX")):
        raise ValueError("indirect branch: paths unknown")
    return [i + 1]


def loops(code: list[dict]) -> list[tuple[int, int]]:
    """(head, latch) of every backward branch, the widest first."""
    found = {(inst["to"], i) for i, inst in enumerate(code)
             if inst["op"].startswith("BRA") and inst["to"] is not None and inst["to"] <= i}
    # An out-of-line retry block (after the kernel's EXIT) branching back to its wait is no loop body.
    found = {(h, l) for h, l in found
             if not any(c["op"].startswith("EXIT") and not c["guard"] for c in code[h:l + 1])}
    return sorted(found, key=lambda hl: (hl[0] - hl[1], hl[0]))


def trips(code: list[dict], head: int, latch: int, limit: int = 200000) -> Counter:
    """Counter of (instructions, *COUNTED) over the acyclic paths head -> latch's back edge, staying in
    [head, latch]; a back edge inside the range ends that path (an inner loop's first trip only)."""
    result: Counter = Counter()
    stack = [(head, (0,) * (1 + len(COUNTED)), frozenset())]
    while stack:
        i, counts, seen = stack.pop()
        if len(result) > limit:
            raise RuntimeError("too many paths")
        while True:
            op = code[i]["op"]
            counts = (counts[0] + 1,) + tuple(c + op.startswith(p) for c, p in zip(counts[1:], COUNTED))
            nxt = successors(code, i)
            if i == latch:
                result[counts] += 1
                nxt = [j for j in nxt if j != head]
            nxt = [j for j in nxt if head <= j <= latch and (j > i or j == head) and j not in seen]
            nxt = [j for j in nxt if j != head]
            if not nxt:
                break
            for j in nxt[1:]:
                stack.append((j, counts, seen | {i}))
            i = nxt[0]
    return result


def main_loop_trips(text: str) -> list[dict]:
    """The widest loop's trips (see trips), each {"instructions": n, "MUFU.EX2": n, ...}."""
    code = parse(text)
    head, latch = max(loops(code), key=lambda hl: hl[1] - hl[0])
    names = ("instructions",) + COUNTED
    return [dict(zip(names, counts)) for counts in trips(code, head, latch)]


def report(name: str, text: str, top: int = 3) -> None:
    code = parse(text)
    print(f"== {name}: {len(code)} instructions, MUFU.EX2 {sum(c['op'].startswith('MUFU.EX2') for c in code)}")
    shown = []
    for head, latch in loops(code):
        if latch - head < 16:
            continue  # mbarrier try-wait and uniformity loops
        shown.append((head, latch))
        body = code[head:latch + 1]
        print(f"  loop [{head}, {latch}]: {len(body)} static, MUFU.EX2 {sum(c['op'].startswith('MUFU.EX2') for c in body)},"
              f" HGMMA {sum(c['op'].startswith('HGMMA') for c in body)}")
        try:
            paths = trips(code, head, latch)
        except RuntimeError as exc:
            print(f"    {exc}")
            continue
        for counts, n in sorted(paths.items(), key=lambda kv: -kv[1])[:top]:
            named = ", ".join(f"{p} {c}" for p, c in zip(COUNTED, counts[1:]))
            print(f"    {n} path(s): {counts[0]} executed, {named}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--bwd", action="append", default=[], help="a sass_report bwd spec to compile (sm_90a)")
    p.add_argument("--flavour", default="auto")
    p.add_argument("--top", type=int, default=3, help="distinct path tuples shown per loop")
    args = p.parse_args()
    import sass_stats_lib as lib

    for f in args.files:
        report(f.name, lib.disassemble(f) if f.suffix == ".cubin" else f.read_text(), args.top)
    for spec in args.bwd:
        import sass_report

        report(f"bwd {spec}", sass_report.compile_sass("bwd", "sm_90a", spec, args.flavour), args.top)


if __name__ == "__main__":
    main()
