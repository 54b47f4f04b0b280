"""The single-file scripts repeat their common blocks on purpose; this keeps the copies byte-identical and in the same
order, so that `diff ppo_procgen.py ppg_procgen.py` (or vtrace.py) shows only what each script changes."""
import ast
import os

import pytest
from conftest import ROOT

# Top-level definitions that each algorithm is allowed to change; everything else they share must be identical.
# `checkpoint_state` is each script's one dict of what --resume continues from (PPG adds its auxiliary optimizer).
# `ppo_update` differs in one line: PPO's K epochs of both losses, PPG's E_pi and E_V.
ALGORITHM_SPECIFIC = {"Args", "Agent", "check_args", "train", "CPU_NOTE", "checkpoint_state", "ppo_update"}


def top_level(path):
    source = open(path).read()
    blocks = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):  # with decorators (get_source_segment leaves them out)
            decorators = [ast.get_source_segment(source, d) for d in node.decorator_list]
            blocks[node.name] = (decorators, ast.get_source_segment(source, node))
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            blocks[node.targets[0].id] = ast.get_source_segment(source, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            blocks.setdefault("imports", []).append(ast.get_source_segment(source, node))
    return blocks


def script(name):
    path = os.path.join(ROOT, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} not written yet")
    return path


@pytest.mark.parametrize("other", ["ppg_procgen.py", "vtrace.py"])
def test_shared_blocks_are_identical(other):
    ppo, them = top_level(script("ppo_procgen.py")), top_level(script(other))
    shared = (set(ppo) & set(them)) - ALGORITHM_SPECIFIC - {"imports"}
    assert {"ProcgenVecEnv", "make_env", "ImpalaCNN", "Logger", "save_checkpoint", "evaluate", "start_run", "run_folder",
            "restore", "Run", "StopOnSignal", "evaluate_and_log", "load_checkpoint"} <= shared
    different = sorted(name for name in shared if ppo[name] != them[name])
    assert not different, f"{other} differs from ppo_procgen.py in shared blocks {different}: change both"


@pytest.mark.parametrize("other", ["ppg_procgen.py", "vtrace.py"])
def test_shared_blocks_keep_their_order(other):
    """diff lines blocks up only when they come in the same order."""
    ppo, them = list(top_level(script("ppo_procgen.py"))), list(top_level(script(other)))
    common = [name for name in ppo if name in them]
    assert common == [name for name in them if name in ppo]


def test_args_fields_in_common_are_identical_except_documented_defaults():
    def fields(path):
        node = next(n for n in ast.parse(open(path).read()).body if isinstance(n, ast.ClassDef) and n.name == "Args")
        return {stmt.target.id: ast.unparse(stmt) for stmt in node.body if isinstance(stmt, ast.AnnAssign)}
    ppo, ppg = fields(script("ppo_procgen.py")), fields(script("ppg_procgen.py"))
    changed = {name for name in set(ppo) & set(ppg) if ppo[name] != ppg[name]}
    # PPG's defaults follow its paper and code: full-batch advantage normalization, normed init, no gradient clipping,
    # unclipped value loss with weight 1 (PPG Eq. 2), Adam's default epsilon, the reward normalizer's own gamma 0.99,
    # minibatches of whole games.
    assert changed == {"adv_norm", "init", "max_grad_norm", "clip_vloss", "vf_coef", "adam_eps", "reward_norm_gamma",
                       "minibatch_unit"}
    assert set(ppo) - set(ppg) == {"update_epochs"}  # replaced by E_pi and E_V



def flag_help(path):
    """Each Args field's help text: the docstring under it, which tyro shows in --help."""
    node = next(n for n in ast.parse(open(path).read()).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    helps = {}
    for field, after in zip(node.body, node.body[1:] + [None]):
        if isinstance(field, ast.AnnAssign):
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            helps[field.target.id] = " ".join(after.value.value.split()) if is_doc else None
    return helps


@pytest.mark.parametrize("other", ["ppg_procgen.py", "vtrace.py"])
def test_shared_flags_have_the_same_help(other):
    """A flag that two scripts share means the same in both, so its --help says the same (every flag has one)."""
    ppo, them = flag_help(script("ppo_procgen.py")), flag_help(script(other))
    assert None not in ppo.values() and None not in them.values()
    # IMPALA's actor thread changes what three flags mean: the same seed gives the same run only with
    # --deterministic-lag, actor and learner share the CPU's cores, and a resume restarts the actor's lead.
    differs = {"seed", "torch_threads", "resume"} if other == "vtrace.py" else set()
    drifted = sorted(name for name in set(ppo) & set(them) - differs if ppo[name] != them[name])
    assert not drifted, f"{other}'s help of {drifted} differs from ppo_procgen.py's"
