"""The seeds' import paths work with fairscale replaced by shardkit (users migrate by changing an import)."""

import subprocess
import sys


def test_fairscale_and_smp_paths() -> None:
    from shardkit.experimental.nn.data_parallel import SlowMoDistributedDataParallel as ExperimentalSlowMo
    from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel, checkpoint_wrapper, wrap
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardedDataParallel as SDP
    from shardkit.nn.data_parallel import SlowMoDistributedDataParallel
    from shardkit.nn.wrap import auto_wrap, enable_wrap
    from shardkit.nn.wrap import wrap as wrap_fn
    from shardkit.optim import OSS as ShortOSS
    from shardkit.optim.grad_scaler import ShardedGradScaler
    from shardkit.optim.oss import OSS
    from shardkit.utils.testing import DummyProcessGroup

    assert OSS is ShortOSS and FSDP is FullyShardedDataParallel and SDP is ShardedDataParallel
    assert ExperimentalSlowMo is SlowMoDistributedDataParallel
    assert callable(wrap) and callable(wrap_fn) and callable(auto_wrap) and callable(enable_wrap)
    assert callable(checkpoint_wrapper) and ShardedGradScaler is not None
    assert DummyProcessGroup(rank=0, size=1).size() == 1

    import shardkit.modelparallel as smp

    for name in ("init", "DistributedModel", "DistributedOptimizer", "step", "partition", "save", "load"):
        assert hasattr(smp, name), name


def test_core_import_is_light_and_never_imports_lightning() -> None:
    code = (
        "import sys, shardkit, shardkit.nn, shardkit.optim, shardkit.modelparallel;"
        "assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
