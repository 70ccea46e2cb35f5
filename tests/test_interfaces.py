"""The declared interfaces hold for the real parts and for the test doubles that stand in for them."""

from test_batch_engine import ScriptedRows

from dflash2_mlx.core.block_policy import AdaptiveBlockPolicy, BatchWidthPolicy, Costs, FixedBlockPolicy
from dflash2_mlx.core.interfaces import BatchPolicy, DraftModel, TargetModel, WidthPolicy

from test_engine import ScriptedDrafter
from tiny import tiny_drafter, tiny_target


def test_targets_drafters_and_policies_implement_their_interfaces():
    target = tiny_target("qwen3_5")
    assert isinstance(target, TargetModel)
    for drafter in (tiny_drafter(target, "dflash2"), tiny_drafter(target, "dflash"),
                    ScriptedDrafter(target, [1, 2, 3], 4), ScriptedRows(target, [[1, 2, 3]], 4)):
        assert isinstance(drafter, DraftModel), type(drafter).__name__
    costs = Costs((0.01, 0.012, 0.014, 0.016), (0.0, 0.002, 0.002, 0.002))
    for policy in (FixedBlockPolicy(4), AdaptiveBlockPolicy(costs)):
        assert isinstance(policy, WidthPolicy), type(policy).__name__
    assert isinstance(BatchWidthPolicy(costs), BatchPolicy)
    assert not isinstance(object(), TargetModel) and not isinstance(target, DraftModel)
