"""The grading engine that both graders share: run a student's functions on cases, score every case, explain
each failure. It holds no solution: a case carries its inputs, the expected outputs (and gradients) and the answers
of typical mistakes as DATA (the public cases: exercises/cases/*.json; the instructor's hidden cases are made the
same way by exercises/instructor.py from its references).

Every case is run, a failure does not stop the rest, and each case is worth its points. Besides the values, every
case checks the contract that the stubs state: the outputs have the inputs' dtype and device, and the inputs are
never modified in place. The auxiliary phase of PPG is a procedure, so its cases run it on a tiny float64 agent
(`TinyAgent`) whose rollouts the grader can recognise.

The engine has two halves: observe_* run the student's code and record what it did as plain data (outputs,
dtypes, devices, inputs changed, gradients, errors); judge_* compare those records with a case's expectations.
The public grader does both in one process; the instructor's (exercises/sandbox.py) observes in a child process
per submission, which never sees an expectation, and judges in its own."""
import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import math
import os
import re
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import numpy as np
import torch

try:
    from exercises.texts import EXERCISES
except ModuleNotFoundError:  # the sandbox's child: a copy of this file next to texts.py, in no package (sandbox.py)
    from texts import EXERCISES

RTOL, ATOL = 1e-5, 1e-6  # float64 inputs: a correct answer agrees to ~1e-12; float32 work inside still passes
RTOL_32, ATOL_32 = 1e-3, 1e-4  # the float32 contract case
HERE = os.path.dirname(os.path.abspath(__file__))
CASES_DIR = os.path.join(HERE, "cases")
OUTPUT_NAMES = {"ppg_aux_loss": ["loss", "aux_value_loss", "kl", "true_value_loss"],
                "from_importance_weights": ["vs", "pg_advantages"]}


CASE_SECONDS = 30  # a function that never returns costs a submission this much, once per function


class Failed(Exception):
    """A check failed; the message is for the student."""


class OutOfTime(BaseException):
    """A student's function ran past CASE_SECONDS (a BaseException, so that its own `except Exception` cannot
    swallow it)."""


@contextlib.contextmanager
def time_limit(seconds):
    """Raise OutOfTime in the main thread after `seconds` (elsewhere, or without SIGALRM, no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise OutOfTime()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- loading a script
def load_script(path):
    """Import a script from its file path as a fresh module (nothing in a script runs at import time)."""
    path = os.path.abspath(path)
    name = f"graded_{os.path.splitext(os.path.basename(path))[0]}_{abs(hash((path, time.time_ns())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def exercise_text(error):
    """The stub's message (the exercise's text), indented for the report."""
    return textwrap.indent(textwrap.dedent(str(error)).strip(), "    ")


# ---------------------------------------------------------------- cases as data
@dataclasses.dataclass
class Case:
    function: str
    name: str
    inputs: dict  # keyword -> numpy array (becomes a tensor) or a plain value
    expected: list = None  # the outputs, numpy arrays in OUTPUT_NAMES order; for a phase case: its expectations
    grads: dict = dataclasses.field(default_factory=dict)  # input -> expected gradient of the first output
    mistakes: list = dataclasses.field(default_factory=list)  # [{"name", "hint", "outputs"}]
    points: float = 1.0
    hidden: bool = False
    kind: str = "values"  # "values", "float32" (the dtype contract), "meta" and "cuda" (the device's), "phase"


def encode(value):
    if isinstance(value, np.ndarray):
        return {"array": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def decode(value):
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        return np.array(value["array"], dtype=value["dtype"])
    if isinstance(value, dict):
        return {key: decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode(item) for item in value]
    return value


def save_cases(path, cases):
    write_atomic(path, json.dumps([encode(dataclasses.asdict(case)) for case in cases], allow_nan=True) + "\n")


def write_atomic(path, text):
    """`path` written whole or not at all: a temporary file in its folder, flushed and synced, renamed over it."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                         prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(handle, "w", newline="", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def load_cases(function_name, directory=CASES_DIR):
    with open(os.path.join(directory, f"{function_name}.json")) as f:
        return [Case(**decode(item)) for item in json.load(f)]


# ---------------------------------------------------------------- results and the report
@dataclasses.dataclass
class Result:
    item: str
    points: float
    max_points: float
    message: str = ""
    hidden: bool = False
    function: str = ""  # the graded function (the instructor weighs each one a fixed share of the exercise)
    copy: str = ""  # the file of the copy of `function` this case ran on ("" for a check of all copies)

    @property
    def passed(self):
        if self.max_points == 0:  # a check worth no points (the instructor's note): it fails with its message
            return not self.message
        return self.points >= self.max_points


def report_lines(results, verbose=True):
    lines = []
    previous = None
    for result in results:
        mark = "ok  " if result.passed else "FAIL"
        if result.passed and not verbose:
            continue
        lines.append(f"  {mark} {result.points:g}/{result.max_points:g}  {result.item}")
        if result.message and result.message == previous:
            lines.append("        (the same error as above)")
        elif result.message:
            lines.append(textwrap.indent(result.message.rstrip(), "        "))
        previous = result.message or previous
    return lines


def score(results):
    return sum(r.points for r in results), sum(r.max_points for r in results)


# ---------------------------------------------------------------- comparison and messages
def fmt(value):
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            return f"{float(value):.6g}"
        return np.array2string(value, precision=4, suppress_small=True, max_line_width=100, separator=", ")
    return repr(value)


def field(name, value, width):
    """One line of a report, "  name = value", a multi-line array aligned under its first row."""
    return f"  {name:<{width}} = " + fmt(value).replace("\n", "\n" + " " * (width + 5))


def close(got, expected, rtol=RTOL, atol=ATOL):
    """Same shapes and values; infinities and NaNs must match exactly."""
    return len(got) == len(expected) and all(
        np.shape(g) == np.shape(e) and np.allclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        for g, e in zip(got, expected))


def first_difference(got, expected, names):
    for name, g, e in zip(names, got, expected):
        if np.shape(g) != np.shape(e):
            return f"{name}: expected shape {np.shape(e)}, got shape {np.shape(g)}"
        if not np.allclose(g, e, rtol=RTOL, atol=ATOL, equal_nan=True):
            if np.ndim(e) == 0:
                return f"{name}: expected {float(e):.6g}, got {float(g):.6g}"
            bad = np.argwhere(~np.isclose(g, e, rtol=RTOL, atol=ATOL, equal_nan=True))[0]
            where = ", ".join(str(i) for i in bad)
            return f"{name}, first difference at [{where}]: expected {e[tuple(bad)]:.6g}, got {g[tuple(bad)]:.6g}"
    return ""


def describe_inputs(case):
    width = max(len(name) for name in case.inputs)
    return ["inputs:"] + [field(key, value, width) for key, value in case.inputs.items()]


# What a bare PyTorch or Python error means when a student's function raises it: (pattern, explanation).
ERROR_HINTS = [
    (r"Boolean value of Tensor with more than one", "Python's min/max/if/and/or compare whole tensors: use the "
     "elementwise torch.minimum / torch.maximum / torch.clamp / torch.where."),
    (r"a leaf Variable that requires grad is being used in an in-place", "an input is modified in place "
     "(x += ..., x[i] = ..., x.clamp_(...)): never change the inputs; build new tensors from them."),
    (r"modified by an inplace operation", "a tensor that the gradient needs was overwritten in place after it was "
     "used: write into a fresh tensor (torch.zeros_like) or collect the pieces and torch.stack them."),
    (r"backward through the graph a second time", "a graph is reused across optimizer steps: pi_old (or another "
     "stored tensor) was computed WITH gradients. Compute pi_old once, before the first step, under torch.no_grad() "
     "(it is a constant); each minibatch builds its own loss. retain_graph=True would hide the bug, not fix it."),
    (r"does not require grad and does not have a grad_fn", "the loss has no gradient: it was computed under "
     "torch.no_grad(), or from .detach()/.item()/.numpy() values; build it from the network's outputs."),
    (r"tensors used as indices must be long", "an index tensor must be an integer tensor: mask.sum(1) is a float, "
     "use mask.sum(1).long() - 1."),
    (r"NoneType", "a value is None: args.num_aux_rollouts is None by default (the PPG code's 4 per 64 games); the "
     "minibatch size in rollouts is aux_rollouts_per_rank(args)."),
    (r"only one element tensors can be converted|fill_value", "lambda_ may be a per-step tensor (and a 0-dim one): "
     "multiply by it as a tensor; float(lambda_) or torch.full_like(x, lambda_) accept only a number."),
    (r"too many values to unpack|not enough values to unpack", "the inputs may have trailing dims ([T, B, ...]): "
     "take T = values.shape[0] and build new tensors with torch.zeros_like, without unpacking the shape."),
    (r"Can't call numpy\(\) on Tensor that requires grad", "stay in torch: .numpy() cuts the gradient; use torch "
     "operations on the input tensors."),
    (r"expected (scalar type|m1 and m2 to have the same dtype)|found dtype|dtype", "tensors of different dtypes "
     "meet: create new tensors with the inputs' dtype (torch.zeros_like(x), or dtype=x.dtype)."),
    (r"same device|is not on the expected device|Cannot copy out of meta", "tensors on different devices meet: "
     "create new tensors on the inputs' device (torch.zeros_like(x), or device=x.device)."),
    (r"must match the size of tensor|shape '[^']*' is invalid|size mismatch|cannot be broadcast", "the shapes do not "
     "match: check each tensor's shape against the docstring ([T, N] per step, [N] for the state after the "
     "rollout)."),
    (r"out of bounds|out of range", "an index past the end: the last response token is at mask.sum(1) - 1; the "
     "last step of a rollout is T - 1, whose next state is next_value / bootstrap_value."),
]


MESSAGE_CHARS = 2000  # an error's message (and its frames) is cut to this: a report shows it, regexes read it


def error_record(error):
    """An exception as plain data, made where it was raised: its type and message, the student's own last frames
    (not torch's, not the grader's) and the last one's line, whether it is the stub's NotImplementedError or a
    FloatingPointError."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if "site-packages" not in frame.filename and os.path.dirname(frame.filename) != HERE]
    return {"type": type(error).__name__[:200], "message": str(error)[:MESSAGE_CHARS],
            "frames": "".join(traceback.format_list(frames[-3:])).rstrip()[-MESSAGE_CHARS:],
            "last_line": (frames[-1].line or "")[:MESSAGE_CHARS] if frames else "",
            "blank": isinstance(error, NotImplementedError), "floating_point": isinstance(error, FloatingPointError)}


def explain_error(error):
    """The student's exception (or its error_record) as a short report: the student's own frames, the error, and
    what it usually means. With a hint, torch's own advice (e.g. retain_graph=True) is cut off."""
    record = error if isinstance(error, dict) else error_record(error)
    lines = [record["frames"][-MESSAGE_CHARS:]] if record["frames"] else []
    text = f"{record['type'][:200]}: {record['message'][:MESSAGE_CHARS]}"  # cut before any regex reads it
    hint = next((hint for pattern, hint in ERROR_HINTS if re.search(pattern, text)), None)
    if hint is not None:
        text = text.split(". ", 1)[0].split("\n", 1)[0]
    lines.append(text)
    if hint is not None:
        lines.append(f"hint: {hint}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the student's code on a case: what it did, as data
# The engine is in two halves. OBSERVING runs the student's code and records what it did as plain data (outputs as
# float64 arrays, their dtypes and devices, the inputs it changed, its gradients, the error it raised); JUDGING
# compares those records with a case's expectations and writes the report. The public grader does both in one
# process; the instructor's grader (exercises/sandbox.py) observes in a child process per submission and judges in
# its own, so nothing the student's code does can reach the expectations, the secret or the grade.
def as_tensors(inputs, dtype=torch.float64, device="cpu", grad=()):
    tensors = {}
    for key, value in inputs.items():
        if isinstance(value, np.ndarray):
            value = torch.tensor(value, dtype=dtype, device=device, requires_grad=key in grad)
        tensors[key] = value
    return tensors


def outputs_of(function_name, result):
    """The student's result as a list of tensors, in the reference's order."""
    if function_name == "ppg_aux_loss":
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], (tuple, list))
                and len(result[1]) == 3):
            raise Failed("ppg_aux_loss must return (loss, (aux_value_loss, kl, true_value_loss)); got "
                         f"{type(result).__name__} {result!r:.200}")
        items = [result[0], *result[1]]
    elif function_name == "from_importance_weights":
        if hasattr(result, "vs") and hasattr(result, "pg_advantages"):
            items = [result.vs, result.pg_advantages]
        elif isinstance(result, tuple) and len(result) == 2:
            items = list(result)
        else:
            raise Failed("from_importance_weights must return VTraceReturns(vs=..., pg_advantages=...); got "
                         f"{type(result).__name__}")
    else:
        items = [result]
    for item in items:
        if not torch.is_tensor(item):
            raise Failed(f"{function_name} must return torch tensors (so the gradient can flow and the dtype and "
                         f"device follow the inputs); got {type(item).__name__} {item!r:.100}")
    return items


def numpy_of(items):
    return [item.detach().double().cpu().numpy() for item in items]


def unchanged(before, after):
    """The names of the tensor inputs that the call changed in place."""
    changed = []
    for key, value in before.items():
        if torch.is_tensor(value) and not torch.equal(value.nan_to_num(), after[key].detach().nan_to_num()):
            changed.append(key)
    return changed


def observe_call(function, function_name, inputs, dtype="float64", device="cpu", grad=()):
    """The student's function on a case's inputs, as data: {"error"} (what it raised), {"failed"} (what it returned
    is not the outputs' structure), or the outputs' dtypes and devices, their float64 values, the inputs it changed
    in place and, for the inputs in `grad`, the gradient of its first output. On 'meta' only dtypes and devices."""
    tensors = as_tensors(inputs, dtype=getattr(torch, dtype), device=device, grad=grad)
    before = {key: value.clone() if torch.is_tensor(value) else value for key, value in tensors.items()}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = function(**tensors)
    except Exception as error:
        return {"error": error_record(error)}
    try:
        items = outputs_of(function_name, result)
    except Failed as failure:
        return {"failed": str(failure)}
    observed = {"dtypes": [str(item.dtype) for item in items], "devices": [str(item.device) for item in items]}
    if device == "meta":
        return observed
    observed["outputs"] = numpy_of(items)
    observed["changed"] = unchanged(before, tensors) if not grad else []
    if grad:
        observed.update(observe_gradients(items[0], [tensors[key] for key in grad]))
    return observed


def observe_gradients(loss, wanted):
    if not loss.requires_grad:
        return {"requires_grad": False}
    try:
        grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    except RuntimeError as error:
        return {"requires_grad": True, "grad_error": error_record(error)}
    return {"requires_grad": True, "grads": [None if grad is None else grad.double().cpu().numpy() for grad in grads]}


CALLS = {"float32": ("float32", "cpu"), "meta": ("float64", "meta"), "cuda": ("float64", "cuda")}


def observe_case(module, case):
    """Everything a case needs to know of the student's code, as data (the judge decides, judge_case)."""
    try:
        function = getattr(module, case.function, None)  # a module __getattr__ that raises: the check's error
        if function is None:
            return {"missing": True}
        if case.kind == "phase":
            return observe_phase(module, case)
        if case.kind in CALLS:
            dtype, device = CALLS[case.kind]
            return {case.kind: observe_call(function, case.function, case.inputs, dtype, device)}
        observed = {"float64": observe_call(function, case.function, case.inputs)}
        if case.grads:
            observed["grad"] = observe_call(function, case.function, case.inputs, grad=tuple(case.grads))
        return observed
    except Exception as error:  # the grader's own trouble with a strange answer: never stop the other cases
        return {"check_error": error_record(error)}


def observe_cases(module, cases, seconds=None, report=None):
    """One observation per case, in order; with one thread (tiny tensors). A function that runs past `seconds`
    (default CASE_SECONDS) on a case is not run on its later cases. `report(index, observation)`, if given, is
    told each one as soon as it is made (the sandbox's child streams them, so a killed child keeps what it did)."""
    seconds = CASE_SECONDS if seconds is None else seconds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        observations = []
        out_of_time = set()
        for index, case in enumerate(cases):
            if case.function in out_of_time:
                observed = {"not_run": seconds}
            else:
                try:
                    with time_limit(seconds):
                        observed = observe_case(module, case)
                except OutOfTime:
                    out_of_time.add(case.function)
                    observed = {"out_of_time": seconds}
            observations.append(observed)
            if report is not None:
                report(index, observed)
        return observations
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- judging an observation against a case
def find_mistake(case, got, others):
    """The typical mistake that reproduces the student's answer: on this case, and on most of the others."""
    best = None
    for mistake in case.mistakes:
        if not close(got, mistake["outputs"]):
            continue
        name = mistake["name"]
        agree = sum(close(out, m["outputs"]) for c, out in others for m in c.mistakes if m["name"] == name)
        if best is None or agree > best[0]:
            best = (agree, name, mistake["hint"])
    return best


def raise_for_call(function_name, observed):
    """Failed with the exercise's text (a blank), the student's error, or the structure's problem, if any."""
    if "failed" in observed:
        raise Failed(observed["failed"])
    if "error" not in observed:
        return
    error = observed["error"]
    if error["blank"]:
        raise Failed(f"{function_name} is still a blank (it raises NotImplementedError). The exercise:\n\n"
                     + exercise_text(error["message"]))
    raise Failed(f"{function_name} raised an error:\n" + explain_error(error))


def judge_values(case, observed, others):
    """A float64 case: values, dtype, inputs untouched, then the gradients. Raises Failed."""
    names = OUTPUT_NAMES.get(case.function, ["output"])
    call = observed["float64"]
    raise_for_call(case.function, call)
    got = call["outputs"]
    problems = []
    if not close(got, case.expected):
        lines = [f"{case.function} differs from the definition:", *describe_inputs(case), "expected:"]
        width = max(len(name) for name in names)
        lines += [field(name, e, width) for name, e in zip(names, case.expected)]
        lines += ["got:"] + [field(name, g, width) for name, g in zip(names, got)]
        lines.append(first_difference(got, case.expected, names))
        mistake = find_mistake(case, got, others)
        if mistake is not None:
            lines.append(f"hint ({mistake[1]}): {mistake[2]}")
        else:
            lines.append("hint: no common mistake gives this answer; compare your code line by line with the "
                         "equation in the docstring, starting at the first difference.")
        problems.append("\n".join(lines))
    wrong_dtype = [name for name, dtype in zip(names, call["dtypes"]) if dtype != "torch.float64"]
    if wrong_dtype or len(call["dtypes"]) != len(got):
        problems.append(f"float64 inputs gave {', '.join(wrong_dtype)} in {call['dtypes'][0]}.\nhint: outputs must "
                        "have the inputs' dtype (create new tensors with torch.zeros_like(x) or dtype=x.dtype).")
    if call["changed"]:
        problems.append(f"the input(s) {', '.join(call['changed'])} were modified in place.\nhint: a caller "
                        "still needs them (train logs and reuses them). Build new tensors instead of x += ..., "
                        "x[i] = ... or "
                        "x.clamp_(...).")
    if problems:
        raise Failed("\n".join(problems))
    judge_gradients(case, observed.get("grad"))


def judge_gradients(case, observed):
    if not case.grads:
        return
    raise_for_call(case.function, observed)
    if not observed["requires_grad"]:
        raise Failed(f"{case.function}: the value is right but no gradient reaches {', '.join(case.grads)}: do not "
                     ".detach(), .item(), .numpy() or re-wrap the inputs with torch.tensor(...); build the result "
                     "from them with torch operations.")
    if "grad_error" in observed:
        raise Failed(f"{case.function}: the gradient cannot be computed:\n" + explain_error(observed["grad_error"]))
    if len(observed["grads"]) != len(case.grads):
        raise Failed(f"{case.function}: expected {len(case.grads)} gradients, got {len(observed['grads'])}")
    for key, grad in zip(case.grads, observed["grads"]):
        expected = case.grads[key]
        got = np.zeros_like(expected) if grad is None else grad
        if np.shape(got) != np.shape(expected) or not np.allclose(got, expected, rtol=1e-4, atol=1e-6):
            raise Failed(f"{case.function}: the value is right but its gradient with respect to {key} is not:\n"
                         f"{field('expected', expected, 8)}\n{field('got', got, 8)}\nhint: a term computed from "
                         "detached values, or a clamp/max that passes no gradient where it should.")


def judge_float32(case, observed):
    """The same case with float32 inputs: float32 outputs, the values to float32 precision."""
    names = OUTPUT_NAMES.get(case.function, ["output"])
    raise_for_call(case.function, observed)
    wrong = [name for name, dtype in zip(names, observed["dtypes"]) if dtype != "torch.float32"]
    if wrong:
        raise Failed(f"float32 inputs gave {', '.join(wrong)} in {observed['dtypes'][0]}.\nhint: outputs must have "
                     "the inputs' dtype (torch.zeros_like(x), dtype=x.dtype; a Python float keeps a tensor's "
                     "dtype, a numpy "
                     "float64 array does not).")
    if not close(observed["outputs"], case.expected, RTOL_32, ATOL_32):
        raise Failed("with float32 inputs the values differ from the float64 answer by more than float32 rounding "
                     f"(rtol {RTOL_32}):\n" + first_difference(observed["outputs"], case.expected, names))


DEVICE_ERRORS = r"is not on the expected device|same device|Expected all tensors to be on"
SETITEM = re.compile(r"\]\s*([-+*/]|//)?=[^=]")  # buffer[t] = value: a value copied into a tensor made elsewhere


def mixes_devices(error):
    """True when the error (its record, error_record) says that the student's function put a tensor on another
    device than its inputs': a CPU tensor met a non-scalar input, or an input's value was copied into a CPU buffer.
    `.cpu()`, `.tolist()` or `.item()` on an input also fail on 'meta' but work on CUDA: no verdict."""
    if re.search(DEVICE_ERRORS, error["message"]):
        return True
    if "Cannot copy out of meta" not in error["message"]:
        return False
    return bool(SETITEM.search(error["last_line"]))


def judge_meta(case, observed):
    """The device contract without a GPU: inputs on PyTorch's 'meta' device (shapes and dtypes, no values), which
    mixes with CPU tensors as CUDA does (0-dim CPU scalars allowed, anything else an error). Outputs must be there
    too. An operation the meta device cannot run gives no verdict (the CUDA case, with a GPU, decides)."""
    names = OUTPUT_NAMES.get(case.function, ["output"])
    if "error" in observed:
        error = observed["error"]
        if mixes_devices(error):
            raise Failed(f"{case.function} mixes devices: its inputs were on another device than the CPU "
                         f"('meta'):\n{explain_error(error)}\nhint: create new tensors on the inputs' device "
                         "(torch.zeros_like(x), or device=x.device).")
        if error["blank"] and "Exercise" in error["message"]:
            raise_for_call(case.function, observed)
        return
    raise_for_call(case.function, observed)
    wrong = [name for name, device in zip(names, observed["devices"]) if device != "meta"]
    if wrong:
        raise Failed(f"inputs on another device ('meta') gave {', '.join(wrong)} on {observed['devices'][0]}.\n"
                     "hint: outputs must be on the inputs' device (torch.zeros_like(x), or device=x.device; never a "
                     "bare torch.zeros(shape) or torch.tensor(list)).")


def judge_cuda(case, observed):
    names = OUTPUT_NAMES.get(case.function, ["output"])
    raise_for_call(case.function, observed)
    wrong = [name for name, device in zip(names, observed["devices"]) if not device.startswith("cuda")]
    if wrong:
        raise Failed(f"CUDA inputs gave {', '.join(wrong)} on {observed['devices'][0]}.\nhint: outputs must be on "
                     "the inputs' device (torch.zeros_like(x), or device=x.device).")
    if not close(observed["outputs"], case.expected, RTOL_32, ATOL_32):
        raise Failed("on CUDA the values differ:\n" + first_difference(observed["outputs"], case.expected, names))


TIMED_OUT = ("timed out: the submission's process was stopped at its limit (wall clock, CPU time or memory) before "
             "this case finished")


def judge_case(case, observed, others, where=""):
    """One case, scored from its observation: its points, or 0 and the reason."""
    label = f"{case.function}{where}: {case.name}"
    if observed is None:
        return Result(label, 0.0, case.points, TIMED_OUT, case.hidden)
    if "not_run" in observed:
        return Result(label, 0.0, case.points, f"not run: {case.function} ran past {observed['not_run']:g} s on an "
                      "earlier case", case.hidden)
    if "out_of_time" in observed:
        return Result(label, 0.0, case.points, f"{case.function} ran past {observed['out_of_time']:g} s on this "
                      "tiny case: an endless loop (a while loop whose index never moves?)", case.hidden)
    if "not_imported" in observed:
        return Result(label, 0.0, case.points, f"not run: {observed['not_imported']}", case.hidden)
    if "stopped" in observed:
        stopped = observed["stopped"]
        message = (f"{TIMED_OUT} ({stopped})" if stopped.startswith("timed out") else
                   f"not run: the submission's process ended before this case: {stopped}")
        return Result(label, 0.0, case.points, message, case.hidden)
    if observed.get("missing"):
        return Result(label, 0.0, case.points, f"{case.function} is not defined in this file", case.hidden)
    try:
        if "check_error" in observed:
            return Result(label, 0.0, case.points, "the check could not run:\n"
                          + explain_error(observed["check_error"]), case.hidden)
        if case.kind == "phase":
            judge_phase(case, observed)
        elif case.kind == "float32":
            judge_float32(case, observed["float32"])
        elif case.kind == "cuda":
            judge_cuda(case, observed["cuda"])
        elif case.kind == "meta":
            judge_meta(case, observed["meta"])
        else:
            judge_values(case, observed, others)
    except Failed as failure:
        return Result(label, 0.0, case.points, str(failure), case.hidden)
    except Exception as error:  # an answer the judge cannot read (a strange or forged observation): no points
        return Result(label, 0.0, case.points, f"the answer could not be read ({type(error).__name__}: {error})",
                      case.hidden)
    return Result(label, case.points, case.points, "", case.hidden)


def judge_cases(cases, observations, where=""):
    """Every case scored from its observation (None: never observed, the process was stopped first)."""
    others = []  # the student's float64 answers on every case, to tell apart mistakes that agree on one case
    for case, observed in zip(cases, observations):
        outputs = ((observed or {}).get("float64") or {}).get("outputs")
        if case.kind == "values" and outputs is not None:
            others.append((case, outputs))
    results = [judge_case(case, observed, [o for o in others if o[0].function == case.function], where)
               for case, observed in zip(cases, observations)]
    answered = {case.function for case, observed in zip(cases, observations) if returned(case, observed)}
    for index, (case, result) in enumerate(zip(cases, results)):
        if result.passed and case.function not in answered:  # e.g. the 'meta' case, where an error may pass
            results[index] = dataclasses.replace(result, points=0.0, message=(
                f"{case.function} returned on none of its cases (it raised an error, or never ran): a function "
                "that only raises scores nothing"))
    return results


def returned(case, observed):
    """True when the student's function returned on this case (outputs of a float64 call, a phase's statistics)."""
    if not isinstance(observed, dict):
        return False
    if case.kind == "phase":
        return "stats" in observed
    call = observed.get("float64")
    return case.kind == "values" and isinstance(call, dict) and "outputs" in call


def contract_cases(cases):
    """The dtype (and, with a GPU, device) contract, one case per function, made from its first float64 case."""
    extra = []
    for case in cases:
        if case.kind != "values" or case.hidden or any(c.function == case.function for c in extra):
            continue
        extra.append(dataclasses.replace(case, name="float32 inputs give float32 outputs", kind="float32",
                                         mistakes=[], grads={}))
        extra.append(dataclasses.replace(case, name="inputs on another device give outputs there (the 'meta' "
                                         "device: shapes, no values)", kind="meta", mistakes=[], grads={}))
        if torch.cuda.is_available():
            extra.append(dataclasses.replace(case, name="CUDA inputs give CUDA outputs", kind="cuda", mistakes=[],
                                             grads={}))
    return extra


def run_cases(module, cases, where=""):
    """Every case of `cases` (and the contract cases made from them) observed and judged in this process."""
    cases = list(cases) + contract_cases(cases)
    return judge_cases(cases, observe_cases(module, cases), where)


def answer_of(observed):
    """A copy's float64 answer on a case, or what it did instead (for copies_agree)."""
    call = (observed or {}).get("float64")
    if call is None:
        return "did not finish (timed out)"
    if "error" in call:
        return f"{call['error']['type']}: {call['error']['message']}"
    if "failed" in call:
        return call["failed"]
    return call["outputs"]


def copies_agree(function_name, observed_copies, cases):
    """Two files' copies of one function give the same answers on every case (a harmless difference in the one
    copy would hide a wrong copy otherwise). `observed_copies`: {file: its observations of `cases`}. Returns a
    Result worth one point."""
    names = list(observed_copies)
    label = f"{function_name}: the copies in {' and '.join(names)} agree"
    for index, case in enumerate(cases):
        if case.kind != "values":
            continue
        answers = [answer_of(observed_copies[name][index]) for name in names]
        if any(isinstance(a, str) for a in answers) or not all(close(a, answers[0]) for a in answers[1:]):
            detail = "\n".join(f"  {name}: {fmt(a[0]) if not isinstance(a, str) else a}"
                               for name, a in zip(names, answers))
            return Result(label, 0.0, 1.0, f"the copies give different answers on '{case.name}':\n{detail}\n"
                          "hint: the scripts share this function; keep one solution and paste it into every copy.")
    return Result(label, 1.0, 1.0)


# ---------------------------------------------------------------- PPG's auxiliary phase, on a tiny agent
class TinyAgent(torch.nn.Module):
    """A float64 stand-in for PPG's agent: forward_aux(obs) -> (logits, value, aux_value) from a frame's first
    pixel (3 numbers); theta_pi = (trunk, policy, aux) and theta_V = (value_hidden, value) as two parameter groups. The
    frame's second pixel holds the rollout's index and the step's (so the grader sees which rollouts a minibatch
    holds), and every forward pass with gradients is logged."""

    def __init__(self, weights):
        super().__init__()
        for name, array in weights.items():
            setattr(self, name, torch.nn.Parameter(torch.tensor(array, dtype=torch.float64)))
        self.calls = []

    def features(self, obs):
        return obs[:, 0, 0, :].double() / 255.0

    def forward_aux(self, obs):
        if torch.is_grad_enabled():
            self.calls.append(sorted(set(obs[:, 0, 1, 0].tolist())))
        hidden = torch.tanh(self.features(obs) @ self.trunk)  # shared: L_aux moves the policy too, so the KL acts
        logits = hidden @ self.policy_weight + self.policy_bias
        aux_value = hidden @ self.aux_weight + self.aux_bias
        value = torch.tanh(self.features(obs) @ self.value_hidden) @ self.value_weight + self.value_bias
        return logits, value, aux_value

    def networks(self):
        return [{"params": [self.trunk, self.policy_weight, self.policy_bias, self.aux_weight, self.aux_bias]},
                {"params": [self.value_hidden, self.value_weight, self.value_bias]}]

    def flat(self):
        return torch.cat([p.detach().flatten() for p in self.parameters()]).numpy()


def phase_buffer(features, targets):
    """aux_obs [R, T, 64, 64, 3] uint8: pixel (0, 0) the features, pixel (0, 1) the rollout's and step's index."""
    rollouts, steps = features.shape[:2]
    aux_obs = torch.zeros((rollouts, steps, 64, 64, 3), dtype=torch.uint8)
    aux_obs[:, :, 0, 0, :] = torch.tensor(features, dtype=torch.uint8)
    aux_obs[:, :, 0, 1, 0] = torch.arange(rollouts)[:, None]
    aux_obs[:, :, 0, 1, 1] = torch.arange(steps)[None, :]
    return aux_obs, torch.tensor(targets, dtype=torch.float64)


def phase_args(module, settings):
    fields = {f.name for f in dataclasses.fields(module.Args)}
    missing = sorted(set(settings) - fields)
    if missing:
        raise Failed(f"this script's Args lacks {', '.join(missing)}, which the auxiliary phase needs")
    return module.Args(**settings)


def run_phase(module, inputs, agent):
    """The student's auxiliary_phase on the case's buffer with plain SGD; returns (stats, optimizer steps)."""
    aux_obs, targets = phase_buffer(inputs["features"], inputs["targets"])
    args = phase_args(module, inputs["args"])
    optimizer = torch.optim.SGD(agent.networks(), lr=inputs["lr"])
    if inputs.get("leftover") is not None:  # the policy phase's gradients, still in .grad when the phase starts
        for name, array in inputs["leftover"].items():
            getattr(agent, name).grad = torch.tensor(array, dtype=torch.float64)
    torch.manual_seed(0)  # the student's shuffle: the same draws at every grading
    steps = []
    step = optimizer.step

    def counted_step(*args, **kwargs):
        steps.append(len(agent.calls))
        return step(*args, **kwargs)

    optimizer.step = counted_step
    function = module.auxiliary_phase
    available = dict(agent=agent, forward_aux=agent.forward_aux, optimizer=optimizer, aux_obs=aux_obs,
                     aux_value_targets=targets, args=args, device=torch.device("cpu"), autocast=contextlib.nullcontext)
    parameters = inspect.signature(function).parameters
    unknown = [name for name, p in parameters.items() if name not in available and p.default is inspect.Parameter.empty]
    if unknown:
        raise Failed(f"auxiliary_phase has parameters the grader does not know: {unknown} (it passes "
                     f"{sorted(available)})")
    before = (aux_obs.clone(), targets.clone())
    try:
        stats = function(**{name: value for name, value in available.items() if name in parameters})
    finally:
        if not (torch.equal(before[0], aux_obs) and torch.equal(before[1].nan_to_num(), targets.nan_to_num())):
            raise Failed("auxiliary_phase modified the buffer (aux_obs or aux_value_targets) in place: the caller "
                         "keeps the buffer; read it, never write it.")
    return stats, steps


def plain_stats(stats):
    """The phase's returned statistics as numbers ({key: float}), or None when they are not a dict of numbers."""
    if not isinstance(stats, dict):
        return None
    try:
        return {str(key): float(value) for key, value in stats.items()}
    except (TypeError, ValueError, RuntimeError):
        return None


def observe_phase(module, case):
    """The student's auxiliary_phase on a case's buffer, as data: the statistics it returned, the optimizer steps,
    the rollouts of each forward pass with gradients, the weights before and after; or what it raised."""
    agent = TinyAgent(case.inputs["init"])
    initial = agent.flat()
    try:
        stats, steps = run_phase(module, case.inputs, agent)
    except Failed as failure:
        return {"failed": str(failure)}
    except Exception as error:
        return {"error": error_record(error), "initial": initial, "weights": agent.flat()}
    return {"stats": plain_stats(stats), "stats_repr": f"{stats!r:.200}", "steps": steps, "calls": agent.calls,
            "initial": initial, "weights": agent.flat()}


def judge_phase(case, observed):
    """One procedure case of the auxiliary phase: what it checks is listed in case.expected."""
    expected = case.expected
    if "failed" in observed:
        raise Failed(observed["failed"])
    if expected.get("raises"):
        judge_phase_raises(case, observed)
        return
    if "error" in observed:
        if observed["error"]["blank"]:
            raise Failed("auxiliary_phase is still a blank (it raises NotImplementedError). The exercise:\n\n"
                         + exercise_text(observed["error"]["message"]))
        raise Failed("auxiliary_phase raised an error:\n" + explain_error(observed["error"]))
    stats, steps, calls = observed["stats"], observed["steps"], observed["calls"]
    problems = []
    keys = ["aux/aux_value_loss", "aux/kl", "aux/value_loss"]
    if stats is None or set(stats) != set(keys):
        raise Failed(f"auxiliary_phase must return a dict with the keys {keys}; got {observed['stats_repr']}")
    if "steps" in expected and len(steps) != expected["steps"]:
        problems.append(f"expected {expected['steps']} optimizer steps ({expected['why_steps']}), got {len(steps)}.")
    if "minibatch" in expected:
        sizes = sorted({len(rollouts) for rollouts in calls})
        if sizes != [expected["minibatch"]] and len(steps) == expected.get("steps"):
            problems.append(f"each forward pass with gradients should see {expected['minibatch']} rollouts, saw "
                            f"{sizes}.")
    if "shuffle" in expected:
        problems += shuffle_problems(calls, steps, expected)
    if "stats" in expected:
        for key in keys:
            if not math.isclose(stats[key], expected["stats"][key], rel_tol=1e-4, abs_tol=1e-6):
                problems.append(f"{key} should be {expected['stats'][key]:.6g}, got {stats[key]:.6g}.")
    if "weights" in expected:
        got = np.asarray(observed["weights"], dtype=float)
        if np.shape(got) != np.shape(expected["weights"]) or not np.allclose(got, expected["weights"], rtol=1e-4,
                                                                              atol=1e-6):
            problems.append(f"the weights after the phase differ from Algorithm 1's (plain SGD) by up to "
                            f"{np.abs(got - expected['weights']).max():.3g}.")
            for mistake in case.mistakes:
                if np.allclose(got, mistake["outputs"], rtol=1e-4, atol=1e-6):
                    problems.append(f"hint ({mistake['name']}): {mistake['hint']}")
                    break
    if problems:
        raise Failed("\n".join(problems + [f"hint: {expected['hint']}"]))


def shuffle_problems(calls, steps, expected):
    """Each epoch visits every rollout once; the epochs' orders are shuffled (not storage order, not one order)."""
    rollouts, per_epoch = expected["shuffle"]
    if len(steps) != per_epoch * expected["epochs"]:
        return []  # the step count already failed
    groups = [tuple(call) for call in calls]
    if len(groups) != len(steps):
        return [f"expected one forward pass with gradients per minibatch ({len(steps)}), got {len(groups)}."]
    epochs = [groups[i * per_epoch:(i + 1) * per_epoch] for i in range(expected["epochs"])]
    for number, epoch in enumerate(epochs, 1):
        seen = sorted(r for group in epoch for r in group)
        if seen != list(range(rollouts)):
            return [f"epoch {number} did not visit each of the {rollouts} rollouts once: {epoch}."]
    storage = [tuple(range(i, i + rollouts // per_epoch)) for i in range(0, rollouts, rollouts // per_epoch)]
    if all(epoch == storage for epoch in epochs):
        return [f"the rollouts are never shuffled (every epoch visits {storage})."]
    if all(epoch == epochs[0] for epoch in epochs):
        return [f"the rollouts are shuffled once, not in each epoch (every epoch visits {epochs[0]})."]
    return []




def judge_phase_raises(case, observed):
    weights = np.asarray(observed["weights"], dtype=float)
    if "error" in observed:
        error = observed["error"]
        if error["floating_point"]:
            if not np.array_equal(weights, np.asarray(observed["initial"], dtype=float), equal_nan=True):
                raise Failed("auxiliary_phase raised FloatingPointError, but only after a step had put the "
                             "non-finite gradient into the weights: check the clipped gradient norms before "
                             "optimizer.step().")
            return
        if error["blank"]:
            raise Failed("auxiliary_phase is still a blank (it raises NotImplementedError). The exercise:\n\n"
                         + exercise_text(error["message"]))
        raise Failed("a non-finite gradient must raise FloatingPointError (as ppo_update does); it raised:\n"
                     + explain_error(error))
    raise Failed(f"a value target is NaN, so the gradient is not finite, and auxiliary_phase did not raise "
                 f"FloatingPointError (the weights now hold NaN: {np.isnan(weights).any()}).\n"
                 f"hint: {case.expected['hint']}")


# ---------------------------------------------------------------- which functions of which files an exercise grades
ALL_FUNCTIONS = [function for exercise in EXERCISES.values() for function in exercise["functions"]]


def names_of(modules):
    """{file: the names it defines} of loaded modules (the sandbox reads them from the files' source instead)."""
    return {name: set(vars(module)) for name, module in modules.items()}


def training_file_of(exercise, defined):
    """The file the exercise trains with: its script if given, else the first file that holds its functions.
    `defined`: {file: the names it defines} (names_of)."""
    holders = [name for name, names in defined.items() if all(f in names for f in EXERCISES[exercise]["functions"])]
    if EXERCISES[exercise]["script"] in holders:
        return EXERCISES[exercise]["script"]
    return holders[0] if holders else None


def functions_to_grade(exercise, defined):
    """{file: [functions]}: the exercise's own functions wherever they are, and every exercise function in the file
    it trains with (that file's other blanks run in its training too)."""
    training_file = training_file_of(exercise, defined)
    plan = {}
    for name, names in defined.items():
        chosen = [f for f in ALL_FUNCTIONS if f in names
                  and (f in EXERCISES[exercise]["functions"] or name == training_file)]
        if chosen:
            plan[name] = chosen
    return plan


def plan_exercise(exercise, defined, cases_for):
    """{file: {function: its cases, the contract cases included}} of everything the exercise grades, or None when
    no file defines the exercise's functions. `cases_for(function)` gives a function's cases."""
    if training_file_of(exercise, defined) is None:
        return None
    cases_of = {}
    plan = {}
    for name, functions in functions_to_grade(exercise, defined).items():
        for function in functions:
            if function not in cases_of:
                cases = list(cases_for(function))
                cases_of[function] = cases + contract_cases(cases)
            plan.setdefault(name, {})[function] = cases_of[function]
    return plan


def nothing_defines(exercise, files):
    functions = ", ".join(EXERCISES[exercise]["functions"])
    return [Result(f"{exercise}: no file defines {functions}", 0.0, 1.0,
                   f"expected {EXERCISES[exercise]['script']} with {functions}; got {', '.join(files)}")]


def judge_exercise(plan, observations):
    """The plan's cases scored from `observations` ({file: {function: [observation per case]}}; a missing one was
    never observed); two copies of one function must agree. Returns a list of Result."""
    results = []
    holders = {}
    for name, functions in plan.items():
        for function, cases in functions.items():
            observed = list(observations.get(name, {}).get(function, []))
            observed += [None] * (len(cases) - len(observed))
            judged = judge_cases(cases, observed[:len(cases)], where=f" [{name}]")
            results += [dataclasses.replace(r, function=function, copy=name) for r in judged]
            holders.setdefault(function, {})[name] = observed
    for function, copies in holders.items():
        if len(copies) > 1 and function != "auxiliary_phase":
            cases = next(functions[function] for functions in plan.values() if function in functions)
            results.append(dataclasses.replace(copies_agree(function, copies, cases), function=function))
    return results


def grade_exercise(exercise, modules, cases_for):
    """Every case of the exercise in every file that matters, each scored; two copies of one function must agree.
    Observed and judged in this process (the public grader). Returns a list of Result."""
    plan = plan_exercise(exercise, names_of(modules), cases_for)
    if plan is None:
        return nothing_defines(exercise, modules)
    observations = {name: {function: observe_cases(modules[name], cases) for function, cases in functions.items()}
                    for name, functions in plan.items()}
    return judge_exercise(plan, observations)
