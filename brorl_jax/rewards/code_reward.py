"""Code verifier: run the completion's Python against APPS/TACO/CodeContests-style tests.

Score = fraction of tests passed (ProRL App. D); a syntax error scores 0; a test that crashes,
exceeds its time limit (ProRL: 5 s) or its output limit fails. Tests run in `sandbox.py`;
expected outputs stay in the worker and are compared here.

ground_truth (dict or its JSON text; an APPS row's "input_output" wrapper is accepted):
  stdin/stdout: {"inputs": [str, ...], "outputs": [str, ...]}
  call style:   {"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value, ...]}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from brorl_jax.rewards.sandbox import SandboxLimits, TestRun, run_python_tests
from brorl_jax.rewards.types import RewardResult, require_field

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last fenced code block tagged python/py (else the last untagged block)."""
    blocks = _FENCE.findall(completion)
    tagged = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if tagged:
        return tagged[-1]
    untagged = [body for lang, body in blocks if not lang]
    return untagged[-1] if untagged else None


def parse_tests(ground_truth: Any) -> tuple[str, str | None, list[str], list[Any]]:
    """Returns (style, fn_name, inputs as the sandbox wants them, expected outputs)."""
    gt = ground_truth
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except ValueError as e:
            raise ValueError(f"code ground_truth is a string but not JSON: {e}") from None
    if isinstance(gt, Mapping) and "input_output" in gt and "inputs" not in gt:
        return parse_tests(gt["input_output"])
    if not isinstance(gt, Mapping) or "inputs" not in gt or "outputs" not in gt:
        raise ValueError("code ground_truth must be {'inputs': [...], 'outputs': [...]} "
                         "(plus 'fn_name' for call-style tests)")
    inputs, outputs = list(gt["inputs"]), list(gt["outputs"])
    if len(inputs) != len(outputs):
        raise ValueError(f"code ground_truth has {len(inputs)} inputs but {len(outputs)} "
                         "outputs; they pair up one to one")
    if not inputs:
        raise ValueError("code ground_truth has no tests")
    fn_name = gt.get("fn_name")
    if fn_name:
        args = [x if isinstance(x, list) else [x] for x in inputs]
        return "call", str(fn_name), [json.dumps(a) for a in args], outputs
    return "stdio", None, [_as_text(x) for x in inputs], outputs


def check_ground_truth(ground_truth: Any) -> None:
    """Raises ValueError (from parse_tests) when the tests cannot be read: run at load time."""
    parse_tests(ground_truth)


def _as_text(x: Any) -> str:
    if isinstance(x, list):
        return "\n".join(str(v) for v in x) + "\n"
    return str(x)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tokens_close(a: list[str], b: list[str], tol: float) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=tol, abs_tol=tol):
            return False
    return True


def stdout_matches(actual: str, expected: Any, float_tolerance: float = 1e-6) -> bool:
    """Line-wise match ignoring trailing whitespace, then token-wise with float tolerance."""
    want = _as_text(expected) if isinstance(expected, list) else str(expected)
    got_lines, want_lines = _lines(actual), _lines(want)
    if got_lines == want_lines:
        return True
    got_tok, want_tok = actual.split(), want.split()
    if got_tok == want_tok:
        return True
    return bool(float_tolerance) and _tokens_close(got_tok, want_tok, float_tolerance)


def _values_equal(got: Any, want: Any, tol: float) -> bool:
    if isinstance(got, bool) or isinstance(want, bool):
        return got is want if isinstance(got, bool) and isinstance(want, bool) else got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return got == want or (bool(tol) and math.isclose(got, want, rel_tol=tol, abs_tol=tol))
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_values_equal(g, w, tol) for g, w in zip(got, want))
    return got == want


def return_matches(returned_json: str | None, expected: Any, float_tolerance: float = 1e-6) -> bool:
    """Call style: equal values (tuples as lists); APPS wraps some outputs in a 1-list."""
    if returned_json is None:
        return False
    try:
        got = json.loads(returned_json)
    except ValueError:
        return False
    if _values_equal(got, expected, float_tolerance):
        return True
    return (isinstance(expected, list) and len(expected) == 1
            and _values_equal(got, expected[0], float_tolerance))


def code_reward(record: Mapping[str, Any], completion: str, *,
                timeout_per_test_s: float = 5.0, total_timeout_s: float = 60.0,
                memory_bytes: int = 1 << 30, file_size_bytes: int = 16 << 20,
                max_output_bytes: int = 16 << 20, max_processes: int = 32,
                max_open_files: int = 64, work_dir_bytes: int = 64 << 20,
                max_tests: int | None = None, require_code_block: bool = True,
                float_tolerance: float = 1e-6, isolation: str | None = None,
                time_budget_s: float | None = None) -> RewardResult:
    """Fraction of tests passed by the completion's last Python code block.

    time_budget_s (the scoring service's per-item timeout) caps total_timeout_s so the
    verdict (with the tests not reached counted as failed) comes back before the service
    would kill the worker.
    """
    style, fn_name, inputs, outputs = parse_tests(require_field(record, "ground_truth", "code"))
    if max_tests is not None:
        inputs, outputs = inputs[:max_tests], outputs[:max_tests]
    code = extract_code(completion)
    if code is None:
        if require_code_block:
            return RewardResult(0.0, "no code block", {})
        code = completion
    total = total_timeout_s
    if time_budget_s is not None:
        total = min(total, max(0.5, 0.8 * time_budget_s - 1.0))
    limits = SandboxLimits(timeout_per_test_s=min(timeout_per_test_s, total),
                           total_timeout_s=total, memory_bytes=memory_bytes,
                           file_size_bytes=file_size_bytes, max_output_bytes=max_output_bytes,
                           max_processes=max_processes, max_open_files=max_open_files,
                           work_dir_bytes=work_dir_bytes)
    result = run_python_tests(code, inputs, style=style, fn_name=fn_name, limits=limits,
                              isolation=isolation)
    if result.compile == "syntax_error":
        return RewardResult(0.0, "syntax error", {"error": result.compile_error[-500:]})
    if result.compile != "ok":
        return RewardResult(0.0, f"sandbox error: {result.compile}"[:300], {})
    outcomes = [_outcome(run, want, style, float_tolerance)
                for run, want in zip(result.tests, outputs)]
    passed = sum(o == "pass" for o in outcomes)
    failures = [o for o in outcomes if o != "pass"]
    reason = f"{passed}/{len(outcomes)} tests passed"
    if failures:
        reason += f" (first failure: {failures[0]})"
    walls = [run.wall_s if run is not None else None for run in result.tests]
    return RewardResult(passed / len(outcomes), reason,
                        {"tests": _summarize(outcomes), "wall_s": walls[:32]})


def _outcome(run: TestRun | None, expected: Any, style: str, tol: float) -> str:
    if run is None:
        return "not run (time budget)"
    if not run.ok:
        return run.failure()
    if style == "stdio":
        ok = run.stdout is not None and stdout_matches(run.stdout, expected, tol)
    else:
        ok = return_matches(run.returned, expected, tol)
    return "pass" if ok else "wrong output"


def _summarize(outcomes: Sequence[str], limit: int = 32) -> list[str]:
    return list(outcomes[:limit]) + ([f"... {len(outcomes) - limit} more"]
                                     if len(outcomes) > limit else [])
