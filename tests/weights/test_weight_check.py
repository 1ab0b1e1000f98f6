"""``scirl.weights.check``: what makes a push fail its check (the probe's tolerance per dtype, replicas
that disagree, weights that did not change when the trainer's did), and when the check runs. The
real pushes that go wrong on purpose are in ``test_train_servers.py`` and ``test_train_vllm.py``."""

from __future__ import annotations

import pytest
import torch

from scirl.distributed import Dist
from scirl.errors import TrainError
from scirl.weights.check import TOLERANCE, Replica, WeightCheck, probe_sequence

IDS, START = [5, 6, 7, 8, 9], 2
EXACT = [-1.0, -2.0, -3.0, -4.0]  # the trainer's logprobs of tokens 1..4


class FakeTrainer:
    def __init__(self, dtype=torch.float32):
        self.dtype, self.dist, self.updates = dtype, Dist(), 0

    def sequence_logprobs(self, ids):
        assert ids == IDS
        return list(EXACT)


def replica(name="http://a:1", offset=0.0, checksums=None):
    return Replica(name, lambda ids: [x + offset for x in EXACT], lambda: checksums)


def test_a_sampler_within_the_dtypes_tolerance_passes_and_reports_the_difference():
    check = WeightCheck(FakeTrainer(), (IDS, START), interval=10)
    metrics = check.run(0, [replica(offset=5e-4)])
    assert metrics["weight_check/logprob_diff"] == pytest.approx(5e-4)
    assert metrics["time/weight_check"] >= 0
    # bf16 rounding noise (a mean of ~0.03 between two bf16 implementations) is no failure in a bf16 run
    assert WeightCheck(FakeTrainer(torch.bfloat16), (IDS, START), interval=10).run(0, [replica(offset=0.05)])


def test_a_sampler_with_other_weights_ends_the_run_naming_it_the_version_and_the_difference():
    check = WeightCheck(FakeTrainer(), (IDS, START), interval=10)
    with pytest.raises(TrainError) as info:
        check.run(7, [replica("http://good:1"), replica("http://stale:2", offset=0.02)])
    message = str(info.value)
    assert message.startswith("http://stale:2 does not hold the trainer's weights after the push of version 7")
    assert "0.02" in message and f"tolerance {TOLERANCE[torch.float32]:g} for float32" in message
    assert "\n" not in message
    with pytest.raises(TrainError, match="tolerance"):  # NaN logprobs fail, never pass
        check.run(8, [replica(offset=float("nan"))])


def test_data_parallel_replicas_that_disagree_fail():
    checksums = {
        "dp0:pp0:pcp0:tp0:model.norm.weight": "aa",
        "dp1:pp0:pcp0:tp0:model.norm.weight": "bb",
        "dp0:pp0:pcp0:tp0:lm_head.weight": "cc",
        "dp1:pp0:pcp0:tp0:lm_head.weight": "cc",
    }
    with pytest.raises(
        TrainError, match=r"replicas hold different weights .*\(1 tensors differ, e.g. pp0:pcp0:tp0:model.norm"
    ):
        WeightCheck(FakeTrainer(), (IDS, START), interval=10).run(0, [replica(checksums=checksums)])


def test_weights_that_did_not_change_while_the_trainers_did_fail():
    trainer = FakeTrainer()
    check = WeightCheck(trainer, (IDS, START), interval=1)
    same = {"dp0:pp0:pcp0:tp0:w": "aa"}
    check.run(0, [replica(checksums=same)])
    check.run(1, [replica(checksums=same)])  # no optimizer step in between (a skipped step): fine
    trainer.updates += 1
    check.run(2, [replica(checksums={"dp0:pp0:pcp0:tp0:w": "bb"})])  # changed with the trainer: fine
    trainer.updates += 1
    with pytest.raises(TrainError, match="holds exactly the weights of version 2 after the push of version 3"):
        check.run(3, [replica(checksums={"dp0:pp0:pcp0:tp0:w": "bb"})])


def test_the_check_runs_on_the_first_push_then_every_interval():
    check = WeightCheck(FakeTrainer(), (IDS, START), interval=10)
    assert check.due(3)  # the first push, whatever its version (a resumed run starts at its checkpoint)
    check.run(3, [replica()])
    assert [v for v in range(4, 31) if check.due(v)] == [10, 20, 30]
    assert not WeightCheck(FakeTrainer(), (IDS, START), interval=0).due(0)  # 0: off


def test_the_probe_is_fixed_and_fits():
    ids, start = probe_sequence([1, 2, 3], token_limit=50, room=100)
    assert ids[:3] == [1, 2, 3] and start == 3 and len(ids) == 3 + 48 and max(ids[3:]) < 50
    assert probe_sequence([1, 2, 3], token_limit=50, room=100) == (ids, start)
    assert len(probe_sequence([1, 2, 3], token_limit=50, room=10)[0]) == 10
