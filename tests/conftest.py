import os

import pytest

try:
    # Triton (loaded by torch._dynamo) segfaults when it loads after Mesa's LLVM, which MuJoCo's EGL
    # rendering brings in; load it first so test order cannot matter.
    import torch._dynamo  # noqa: F401
except ImportError:
    pass

from time_limit import pytest_runtest_protocol  # noqa: E402, F401  (a per-test time limit that names the test)

# Offscreen MuJoCo rendering through Mesa's EGL; without it MuJoCo looks for an X11 display.
os.environ.setdefault("MUJOCO_GL", "egl")


def pytest_sessionstart(session):
    """A DeepSpeed op's build lock that a killed build left behind makes torch releases with `FileBaton` wait
    forever at the op's next build. Training clears such locks when it starts its process group; tests that
    build DeepSpeed engines in a process group someone else made (vLLM's) would not, so the session does (torch's
    extension helpers, which say at import that no CUDA runtime is found, are loaded only where a lock exists)."""
    import glob

    own = os.environ.get("TORCH_EXTENSIONS_DIR")
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    if glob.glob(os.path.join(glob.escape(own), "*", "lock") if own else os.path.join(glob.escape(cache), "*", "*", "lock")):
        from vagen.distributed import clear_stale_build_locks

        clear_stale_build_locks()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """Built-in tiny models are built once per test session, offline, into a temporary cache."""
    return str(tmp_path_factory.mktemp("vagen_models"))


@pytest.fixture(scope="session")
def tiny_vl(model_cache):
    from vagen.models import load_policy, resolve_model_path

    path = resolve_model_path("builtin:tiny-vl", model_cache, seed=0)
    model, processor = load_policy(path)
    return path, model, processor


@pytest.fixture(scope="session")
def tiny_text(model_cache):
    from vagen.models import load_policy, resolve_model_path

    path = resolve_model_path("builtin:tiny-text", model_cache, seed=0)
    model, processor = load_policy(path)
    return path, model, processor


@pytest.fixture(scope="session")
def distributed():
    """A process group of one (gloo on CPU) so that real DeepSpeed engines can be built in tests."""
    from vagen.distributed import init_distributed

    return init_distributed()


@pytest.fixture
def played_tokens(monkeypatch):
    """Every rollout made during the test (`vagen.rollout.rollout`, as evaluation plays, and
    `vagen.rollout.Rollouts.play`, as training plays) appends its episodes' token ids here."""
    import vagen.rollout as rollout_module

    played = []

    def recording(real):
        def play(*args, **kwargs):
            episodes, stats = real(*args, **kwargs)
            played.append([ep.input_ids for ep in episodes])
            return episodes, stats
        return play

    monkeypatch.setattr(rollout_module, "rollout", recording(rollout_module.rollout))
    monkeypatch.setattr(rollout_module.Rollouts, "play", recording(rollout_module.Rollouts.play))
    return played
