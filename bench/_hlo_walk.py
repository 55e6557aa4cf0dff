"""Walk an optimized HLO module (``compiled.as_text()``) kernel by kernel: bytes, flops, copies,
host synchronisations and collectives, with while-loop bodies multiplied by their trip counts.

Why: a deviceless GPU client has no ``cost_analysis()``, and XLA's generic cost analysis counts a
``while`` body once whatever its trip count (docs: /work/shared/compile_without_a_device.md). This
reads the program XLA will run: the top-level instructions of the entry computation, of every
while body/condition, conditional branch and call, each one a kernel (a fusion, a custom call, a
copy, a collective, ...).

Per kernel:
  * bytes: what the kernel reads plus what it writes. A fusion reads each parameter whole, except
    a parameter that only flows (through bitcasts/converts) into slicing ops (dynamic-slice,
    slice, gather): then only the slices; a fusion rooted at an in-place dynamic-update-slice or
    scatter on a parameter reads and writes only the update. A ``copy`` reads and writes its
    operand. Pallas/Triton custom calls are opaque: their cost comes from a declaration (a
    callable given to :func:`walk`, matched by kernel name); undeclared ones count operands +
    outputs and are listed.
  * flops: 2 x output x contraction of every dot (fused or not) and of declared custom calls;
    elementwise work is not counted.
  * split-K: a GEMM fusion whose dot has batch dimensions its operands' logical GEMM does not (the
    default, un-autotuned tiling of a deviceless compile writes float32 partial sums [split, M,
    N]); its traffic counts its operands and one split's output, the rest of the partials' write
    and their read by the consumer are reported apart (``split_k_bytes``), not counted.
  * host syncs: a while loop whose trip count XLA does not know (no ``known_trip_count``) copies
    its predicate to the host and waits, once per iteration; a ``conditional`` does the same for
    its branch index each time it runs.
  * collectives: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    (``-start`` ops counted once), with their bytes.

API (stable: bench/roofline.py and bench/_roofline_update.py use it):
  parse(text) -> Module
  walk(text_or_module, custom=None) -> Cost of the entry computation, with ``loops`` (a list of
      :class:`Loop`, outermost first, each with its body's Cost per iteration) ...
  Cost fields: bytes, flops, split_k_bytes, host_syncs, collectives, collective_bytes, copies
      [(bytes, name, shape, op_name)], custom [(name, bytes, flops)], undeclared [names],
      kernels (count of kernels launched), loops.
  ``custom``: {kernel-name substring: fn(instr: Instr) -> (bytes, flops)}.
  gemms(module) -> [(form, lhs type, rhs type, result type, op_name)]: each GEMM's form.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
            "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5,
            "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1,
            "f8e5m2fnuz": 1, "token": 0}
# HLO element type -> numpy dtype name (for declarations written against jnp dtypes)
NUMPY_NAME = {"pred": "bool", "s8": "int8", "u8": "uint8", "s16": "int16", "u16": "uint16",
              "f16": "float16", "bf16": "bfloat16", "s32": "int32", "u32": "uint32",
              "f32": "float32", "s64": "int64", "u64": "uint64", "f64": "float64"}
_SHAPE = re.compile(r"\b(" + "|".join(sorted(ITEMSIZE, key=len, reverse=True)) +
                    r")\[([0-9,]*)\]")
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
HOST = ("send", "recv", "infeed", "outfeed", "send-done", "recv-done")
SLICING = ("dynamic-slice", "slice", "gather")
TRANSPARENT = ("bitcast", "convert", "reshape", "copy")


@dataclasses.dataclass
class Instr:
    name: str
    type: str                 # the result type text, e.g. "bf16[16,1536]{1,0}" or a tuple
    opcode: str
    operands: list[str]
    attrs: str                # everything after the operand list
    root: bool = False
    operand_text: str = ""    # the raw operand list (a parameter's number)

    @property
    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return shapes_of(self.type)

    @property
    def bytes(self) -> float:
        return nbytes(self.type)

    def attr(self, key: str) -> str | None:
        m = re.search(r"\b" + re.escape(key) + r"=%?([A-Za-z0-9_.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def kernel_name(self) -> str:
        """A Pallas/Triton custom call's kernel name (``name = "..."`` of its backend config),
        else its op_name."""
        m = re.search(r'\bname = \\?"([A-Za-z0-9_.\-]+)', self.attrs)
        return m.group(1) if m else self.op_name

    def backend_config(self) -> dict:
        m = re.search(r"backend_config=(\{.*\})", self.attrs)
        if not m:
            return {}
        text = m.group(1)
        depth = 0
        for i, ch in enumerate(text):     # the balanced JSON object
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                try:
                    return json.loads(text[: i + 1])
                except ValueError:
                    return {}
        return {}


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    by_name: dict

    @property
    def root(self) -> Instr:
        return next((i for i in self.instrs if i.root), self.instrs[-1])

    def users(self, name: str) -> list[Instr]:
        return [i for i in self.instrs if name in i.operands]


@dataclasses.dataclass
class Module:
    computations: dict
    entry: str


def shapes_of(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in
            _SHAPE.findall(type_text)]


def nbytes(type_text: str) -> float:
    return float(sum(ITEMSIZE[d] * math.prod(s) for d, s in shapes_of(type_text)))


def _match_paren(s: str, start: int) -> int:
    depth = 0
    for i in range(start, len(s)):
        c = s[i]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i
    return len(s) - 1


_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([A-Za-z0-9_.\-]+)\s*=\s*")


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def _parse_instr(line: str) -> Instr | None:
    m = _HEAD.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _match_paren(rest, 0)
        type_text, rest = rest[: end + 1], rest[end + 1:].lstrip()
    else:
        sp = rest.find(" ")
        type_text, rest = rest[:sp], rest[sp + 1:].lstrip()
    p = rest.find("(")
    if p < 0:
        return None
    opcode = rest[:p].strip()
    end = _match_paren(rest, p)
    ops_text = re.sub(r"/\*.*?\*/", "", rest[p + 1: end])
    if "%" in ops_text:
        operands = re.findall(r"%([A-Za-z0-9_.\-]+)", ops_text)
    else:   # unoptimized HLO (Lowered.as_text(dialect="hlo")): bare names, maybe typed
        operands = [t.split()[-1] for t in _split_top(ops_text)
                    if t.strip() and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", t.split()[-1])]
    return Instr(m.group(2), type_text, opcode, operands, rest[end + 1:], bool(m.group(1)),
                 ops_text.strip())


def parse(text: str) -> Module:
    comps: dict[str, Computation] = {}
    entry = None
    cur_name, cur = None, None
    for line in text.splitlines():
        if cur is None:
            m = re.match(r"^(ENTRY\s+)?%?([A-Za-z0-9_.\-]+)\s*(\(.*)?\{\s*$", line)
            if m and not line.startswith((" ", "HloModule")):
                cur_name, cur = m.group(2), []
                if m.group(1):
                    entry = cur_name
            continue
        if line.startswith("}"):
            comps[cur_name] = Computation(cur_name, cur, {i.name: i for i in cur})
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            cur.append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)


@dataclasses.dataclass
class Loop:
    name: str
    op_name: str
    trip_count: int | None    # None: not known to XLA (a host sync per iteration)
    body: Cost              # per iteration, nested loops multiplied by their trip counts
    cond: Cost
    depth: int

    def per_iteration(self) -> Cost:
        """Body + condition of one iteration; +1 host sync when the trip count is unknown."""
        c = Cost()
        c.add(self.body)
        c.add(self.cond)
        c.host_syncs += self.trip_count is None
        return c


@dataclasses.dataclass
class Cost:
    bytes: float = 0.0
    flops: float = 0.0
    split_k_bytes: float = 0.0
    host_syncs: float = 0.0
    collectives: float = 0.0
    collective_bytes: float = 0.0
    kernels: float = 0.0
    copies: list = dataclasses.field(default_factory=list)      # (bytes, name, shape, op_name)
    custom: list = dataclasses.field(default_factory=list)      # (kernel, bytes, flops)
    undeclared: list = dataclasses.field(default_factory=list)
    loops: list = dataclasses.field(default_factory=list)
    items: list = dataclasses.field(default_factory=list)       # (bytes, name, type, op_name)

    def add(self, other: Cost, times: float = 1.0) -> None:
        for f in ("bytes", "flops", "split_k_bytes", "host_syncs", "collectives",
                  "collective_bytes", "kernels"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        self.copies += [(b * times, *rest) for b, *rest in other.copies]
        self.custom += [(k, b * times, f * times) for k, b, f in other.custom]
        self.undeclared += other.undeclared
        self.items += [(b * times, *rest) for b, *rest in other.items]

    def largest(self, n: int = 10) -> list:
        """The kernels moving the most bytes: (bytes, name, type, op_name)."""
        return sorted(self.items, key=lambda x: -x[0])[:n]

    def largest_copies(self, n: int = 5) -> list:
        merged: dict = {}
        for b, _name, shape, op in self.copies:
            key = (shape, op)
            merged[key] = merged.get(key, 0.0) + b
        return sorted(((b, s, o) for (s, o), b in merged.items()), reverse=True)[:n]


def _dot_flops(dot: Instr, comp: Computation) -> float:
    out = math.prod(dot.shapes[0][1]) if dot.shapes else 0
    lhs = comp.by_name.get(dot.operands[0]) if dot.operands else None
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", dot.attrs)
    if lhs is None or not m or not lhs.shapes:
        return 0.0
    dims = lhs.shapes[0][1]
    k = math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
    return 2.0 * out * k


def _is_split_k(dot: Instr) -> bool:
    """A dot with batch dims inside a GEMM fusion, accumulating in f32: the split-K form of a
    plain GEMM (the decode program has no batched GEMMs outside its Pallas kernels)."""
    return bool(re.search(r"lhs_batch_dims=\{[0-9]", dot.attrs)) and dot.type.startswith("f32")


class _Walker:
    def __init__(self, module: Module, custom: dict[str, Callable] | None):
        self.m = module
        self.custom = custom or {}
        self.split_k: dict[str, float] = {}     # instr name -> split factor (in its computation)

    # -- fusions --------------------------------------------------------------------------------
    def _param_read(self, fused: Computation, param: Instr, full: float) -> float:
        """Bytes a fusion reads of one parameter: its slices if it only flows into slicing ops."""
        itemsize = ITEMSIZE.get(param.shapes[0][0], 4) if param.shapes else 4
        total, frontier, seen = 0.0, [param], set()
        while frontier:
            node = frontier.pop()
            for u in fused.users(node.name):
                if u.name in seen:
                    continue
                seen.add(u.name)
                if u.opcode in SLICING and u.operands and u.operands[0] == node.name:
                    total += itemsize * sum(math.prod(s) for _, s in u.shapes)
                elif u.opcode in TRANSPARENT:
                    frontier.append(u)
                elif (u.opcode in ("dynamic-update-slice", "scatter") and u.operands
                      and u.operands[0] == node.name and u is fused.root):
                    pass                     # in place: the update is counted on the output
                else:
                    return full
        return min(total, full)

    def _fusion(self, ins: Instr, parent: Computation, cost: Cost) -> None:
        fused = self.m.computations.get(ins.attr("calls") or "")
        if fused is None:
            cost.bytes += ins.bytes + sum(self._operand_bytes(parent, o) for o in ins.operands)
            return
        read = 0.0
        for p in (i for i in fused.instrs if i.opcode == "parameter"):
            idx = int(p.operand_text)
            if idx >= len(ins.operands):
                continue
            src = ins.operands[idx]
            full = self._operand_bytes(parent, src)
            r = self._param_read(fused, p, full)
            split = self.split_k.get(src)
            if split:        # a consumer of split-K partials: count one split's worth
                cost.split_k_bytes += r * (split - 1) / split
                r /= split
            read += r
        root = fused.root
        roots = ([fused.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root])
        write = 0.0
        for r_ in roots:
            # in place on a parameter: the kernel writes the update's elements over the
            # buffer (whole elements: the old ones are not read); what the update is computed
            # from is counted among the parameters' reads above
            if r_.opcode == "dynamic-update-slice" and len(r_.operands) > 1:
                upd = fused.by_name.get(r_.operands[1])
                write += upd.bytes if upd else 0
            elif r_.opcode == "scatter" and len(r_.operands) > 2:
                upd = fused.by_name.get(r_.operands[-1])
                write += upd.bytes if upd else 0
            else:
                write += r_.bytes
        dots = [i for i in fused.instrs if i.opcode in ("dot", "convolution")]
        flops = sum(_dot_flops(d, fused) for d in dots)
        split = 0
        for d in dots:
            if _is_split_k(d):
                split = max(split, d.shapes[0][1][0])
        if split > 1:
            self.split_k[ins.name] = split
            cost.split_k_bytes += write * (split - 1) / split
            write /= split
        # nested (fused) computations called from this one: count their dots too
        cost.bytes += read + write
        cost.flops += flops
        cost.kernels += 1

    def _operand_bytes(self, comp: Computation, name: str) -> float:
        src = comp.by_name.get(name)
        return src.bytes if src is not None else 0.0

    # -- computations ---------------------------------------------------------------------------
    def computation(self, name: str, depth: int = 0) -> Cost:
        comp = self.m.computations[name]
        self._comp = comp
        cost = Cost()
        for ins in comp.instrs:
            op = ins.opcode
            if op in FREE:
                continue
            if op not in ("while", "conditional", "call", "async-start"):
                before = cost.bytes
                self._instr(ins, comp, cost, depth)
                cost.items.append((cost.bytes - before, ins.name, ins.type.split("{")[0][:80],
                                   ins.op_name))
                continue
            if op == "while":
                body = self.computation(ins.attr("body"), depth + 1)
                cond = self.computation(ins.attr("condition"), depth + 1)
                self._comp = comp
                trip = ins.backend_config().get("known_trip_count", {}).get("n")
                trip = int(trip) if trip is not None else None
                loop = Loop(ins.name, ins.op_name, trip, body, cond, depth)
                cost.loops.append(loop)
                cost.loops += body.loops
                if trip is not None:     # unknown: read Loop.per_iteration() from `loops`
                    cost.add(body, trip)
                    cost.add(cond, trip + 1)
                continue
            if op == "conditional":
                branches = re.findall(r"%([A-Za-z0-9_.\-]+)",
                                      (re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                                       or re.search(r"(true_computation=\S+.*?false_computation"
                                                    r"=\S+)", ins.attrs) or
                                       re.search(r"()", "")).group(1))
                costs = [self.computation(b, depth + 1) for b in branches]
                self._comp = comp
                if costs:
                    worst = max(costs, key=lambda c: c.bytes)
                    cost.add(worst)
                cost.host_syncs += 1
                cost.kernels += 1
                continue
            if op in ("call", "async-start"):
                callee = ins.attr("to_apply") or ins.attr("calls")
                if callee in self.m.computations:
                    cost.add(self.computation(callee, depth))
                    self._comp = comp
                continue
        return cost

    def _instr(self, ins: Instr, comp: Computation, cost: Cost, depth: int) -> None:
        op = ins.opcode
        if op == "fusion":
            self._fusion(ins, comp, cost)
            return
        operand_bytes = sum(self._operand_bytes(comp, o) for o in ins.operands)
        if op == "custom-call":
            self._custom(ins, operand_bytes, cost)
            return
        base = op.removesuffix("-start")
        if base in COLLECTIVES or op.endswith("-done") and op[:-5] in COLLECTIVES:
            if not op.endswith("-done"):
                cost.collectives += 1
                cost.collective_bytes += operand_bytes
                cost.bytes += operand_bytes + ins.bytes
                cost.kernels += 1
            return
        if op in HOST:
            cost.host_syncs += 1
            return
        if op in ("copy", "copy-start"):
            b = 2 * operand_bytes
            cost.bytes += b
            cost.kernels += 1
            cost.copies.append((b, ins.name, ins.type.split("{")[0], ins.op_name))
            return
        if op == "copy-done":
            return
        if op == "dynamic-update-slice" and len(ins.operands) > 1:
            cost.bytes += 2 * self._operand_bytes(comp, ins.operands[1])
        elif op in ("dynamic-slice", "slice"):
            cost.bytes += 2 * ins.bytes
        else:
            cost.bytes += operand_bytes + ins.bytes
        if op in ("dot", "convolution"):
            cost.flops += _dot_flops(ins, comp)
        cost.kernels += 1

    def _custom(self, ins: Instr, operand_bytes: float, cost: Cost) -> None:
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        target = target.group(1) if target else ""
        text = ins.op_name + " " + (re.search(r'\bname = "([^"]*)"', ins.attrs) or
                                    re.search(r"()", "")).group(1)
        for key, fn in sorted(self.custom.items(), key=lambda kv: -len(kv[0])):  # longest first
            if key in text:
                b, f = fn(ins)
                cost.bytes += b
                cost.flops += f
                cost.kernels += 1
                cost.custom.append((key, b, f))
                return
        cost.bytes += operand_bytes + ins.bytes
        cost.kernels += 1
        if "gemm" in target or "matmul" in target:      # cuBLAS / cuBLASLt
            dims = ins.backend_config().get("gemm_backend_config", {}).get(
                "dot_dimension_numbers", {})
            lhs = self._comp.by_name.get(ins.operands[0]) if ins.operands else None
            out = ins.shapes[0][1] if ins.shapes else ()
            if lhs is not None and lhs.shapes:
                k = math.prod(lhs.shapes[0][1][int(d)]
                              for d in dims.get("lhs_contracting_dimensions", []))
                cost.flops += 2.0 * math.prod(out) * k
        else:
            cost.undeclared.append(ins.op_name or ins.name)


def walk(text_or_module, custom: dict[str, Callable] | None = None) -> Cost:
    """The entry computation's Cost (see the module docstring)."""
    module = parse(text_or_module) if isinstance(text_or_module, str) else text_or_module
    return _Walker(module, custom).computation(module.entry)


def operands_of(ins: Instr) -> list[tuple[str, tuple[int, ...]]]:
    """A custom call's operands as [(numpy dtype name, shape)], in order."""
    return [(NUMPY_NAME.get(d, d), s) for d, s in
            (shapes_of(t)[0] for t in operand_types(ins))]


def operand_types(ins: Instr) -> list[str]:
    """The operand types a custom call declares (``operand_layout_constraints``), in order."""
    m = re.search(r"operand_layout_constraints=\{(.*?)\}\s*,\s*(api_version|custom_call|"
                  r"metadata|backend_config|output_to_operand)", ins.attrs)
    if not m:
        return []
    return [f"{d}[{dims}]" for d, dims in _SHAPE.findall(m.group(1))]


_WRAPPERS = re.compile(r"(jvp|transpose|checkpoint|remat|rematted_computation|while|body|cond|"
                       r"pjit|closed_call)\(|\)")


def by_operation(cost: Cost, depth: int = 2) -> list[tuple[float, int, str]]:
    """The kernels' bytes grouped by the JAX operation that made them: the last ``depth``
    components of each kernel's ``op_name`` (jit/jvp/checkpoint wrappers dropped), prefixed
    "backward" for kernels of a transpose (the gradient pass) and "forward" otherwise, as
    [(bytes, kernels, key)], largest first. Loop bodies count times their trip counts (the walk's
    ``items``). How docs/algo.md splits the update's memory-bound traffic by what it does."""
    groups: dict[str, list] = {}
    for b, name, _type, op in cost.items:
        parts = [p for p in _WRAPPERS.sub("", re.sub(r"jit\([^)]*\)/", "", op)).split("/") if p]
        key = ("backward " if "transpose(" in op else "forward ") + (
            "/".join(parts[-depth:]) if parts else name)
        g = groups.setdefault(key, [0.0, 0])
        g[0] += b
        g[1] += 1
    return sorted(((b, n, k) for k, (b, n) in groups.items()), key=lambda x: -x[0])


def _read_type(module: Module, comp: Computation, name: str, caller=None) -> str:
    """The element type a dot reads through ``name``: traced back through layout ops, nested
    fusions and (``caller``: (computation, fusion instr)) the GEMM fusion's parameters to where
    it is made; converts on the way show as "from->to" (a weight dequantized before a plain GEMM,
    in the fusion or in a kernel of its own: "f8e4m3fn->bf16")."""
    node, seen = comp.by_name.get(name), []
    while node is not None and node.shapes:
        seen += [node.shapes[0][0]] if not seen or seen[-1] != node.shapes[0][0] else []
        if node.opcode == "fusion" and node.attr("calls") in module.computations:
            comp = module.computations[node.attr("calls")]
            node = comp.root
        elif node.opcode == "parameter" and caller:
            (comp, ins), caller = caller, None
            node = comp.by_name.get(ins.operands[int(node.operand_text)])
        elif node.opcode in TRANSPARENT + ("transpose", "concatenate", "multiply") and node.operands:
            node = comp.by_name.get(node.operands[0])
        else:
            break
    return "->".join(reversed(seen))


def gemms(module: Module) -> list[tuple[str, str, str, str, str]]:
    """Every GEMM of the program: (form, lhs type, rhs type, result type, op_name); form is
    "triton" (a GEMM fusion's dot) or a cuBLAS / cuBLASLt custom call's target (e.g.
    ``__cublas$lt$matmul$f8``). How the roofline says which GEMM an fp8 projection became."""
    out = []
    for comp in module.computations.values():
        for ins in comp.instrs:
            target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
            kind = ins.backend_config().get("fusion_backend_config", {}).get("kind", "")
            if ins.opcode == "custom-call" and target and re.search("gemm|matmul", target[1]):
                out.append((target[1], *(_read_type(module, comp, o) for o in ins.operands[:2]),
                            ins.shapes[0][0], ins.op_name))
            elif ins.opcode == "fusion" and "gemm" in kind:
                fused = module.computations[ins.attr("calls")]
                out += [("triton", *(_read_type(module, fused, o, (comp, ins))
                                     for o in d.operands[:2]), d.shapes[0][0], ins.op_name)
                        for d in fused.instrs if d.opcode == "dot"]
    return out


def main(argv=None) -> int:
    """python bench/_hlo_walk.py FILE.hlo [--depth 2] [--top 40]: a saved optimized HLO (e.g.
    ``bench/_roofline_update.py --hlo FILE``) walked, its traffic by JAX operation."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("hlo")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    with open(args.hlo) as f:
        cost = walk(f.read())
    print(f"{cost.bytes / 1e9:.1f} GB, {cost.flops / 1e12:.1f} TFLOP (dots), "
          f"{cost.kernels:.0f} kernel launches")
    for b, n, key in by_operation(cost, args.depth)[:args.top]:
        print(f"{b / 1e9:9.2f} GB {n:6d} kernels  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
