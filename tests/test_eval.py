"""Evaluation that scales (issue 27, item 4): every rank evaluates its share of the eval rows and one
all-reduce of fixed size combines them; AUC and log-loss equal the single-process figures within 1e-4;
`trainer.eval_max_rows` caps the periodic evals, the final eval is whole.

1. `ScoreHistogram` against the exact `auc`/`logloss`: realistic and adversarial scores; parts summed
   equal the whole; the bins keep the logits' order.
2. A real 2-process gloo group: the combined figures equal one process's, each rank reads only its rows.
3. A real local run (submitit's executor, 2 ranks): the periodic evals read `eval_max_rows` rows, the final
   one all of them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import read_metrics, read_result, submit

from gpujobs.attempt.local import free_port
from gpujobs.rank import collectives
from gpujobs.rank.task import eval_share
from jobs.rec.config import DLRMConfig, SyntheticClicksConfig
from jobs.rec.metrics import BINS, ScoreHistogram, auc, logit_bins, logloss
from jobs.rec.task import RecTask, build_task

CPU = torch.device("cpu")
TOLERANCE = 1e-4
DATA = SyntheticClicksConfig(
    num_train=4096, num_eval=3001, num_dense=4, cardinalities=[30, 7, 12], batch_size=64, num_interactions=1
)


# ---------------------------------------------------------------- 1. the histogram against the exact figures
def _labelled(logits: torch.Tensor, signal: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` with 0/1 labels drawn from sigmoid(`signal`): the labels follow the scores' order."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(signal.shape, generator=generator) < torch.sigmoid(signal)).float()
    return logits.float(), labels


def _normal(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _scores(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    z = _normal(200_000)
    signal = 1.5 * z - 1.2
    if case == "spread":  # a trained CTR model's logits
        return _labelled(signal, signal, 1)
    if case == "crowded near zero":  # an untrained model's (the rec DLRM's spread ~0.02)
        return _labelled(0.02 + 1e-3 * z, signal, 2)
    if case == "crowded off zero":  # a collapsed model's: 1e-5 apart around -1.2 (float32 steps of 1.2e-7)
        return _labelled(-1.2 + 1e-5 * z, signal, 3)
    if case == "crowded far out":
        return _labelled(30.0 + 1e-2 * z, signal, 7)
    if case == "tied":  # scores on a grid of 1/4: a tie is one half in both
        return _labelled(torch.round(4 * z) / 4, signal, 4)
    if case == "two values":
        return _labelled((z > 0.3).to(torch.float64), signal, 5)
    raise AssertionError(case)


CASES = ["spread", "crowded near zero", "crowded off zero", "crowded far out", "tied", "two values"]


@pytest.mark.parametrize("case", CASES)
def test_histogram_auc_and_logloss_equal_the_exact_figures(case: str) -> None:
    logits, labels = _scores(case)
    counted = ScoreHistogram(center=float(logits[:1024].mean()))  # as the eval centres it
    counted.add(logits, labels)
    exact = auc(logits, labels)
    assert abs(counted.auc() - exact) < TOLERANCE, (counted.auc(), exact)
    assert abs(counted.auc() - exact) <= counted.auc_error_bound()
    assert counted.logloss() == pytest.approx(logloss(logits, labels), abs=1e-12)
    assert counted.rows == logits.numel()


def test_scores_the_bins_cannot_tell_apart_are_caught_by_the_bound() -> None:
    # two tight clusters far apart: the bins are finest at the center, between them, and ~7e-4 wide at
    # either (2**-12 of 3), where the scores lie 1e-3 apart: the AUC is off, and the bound says so
    z = _normal(200_000)
    logits, labels = _labelled(torch.where(z > 0, 2.0 + 1e-3 * z, -3.0 + 1e-3 * z), 1.5 * z - 1.2, 6)
    counted = ScoreHistogram(center=float(logits.mean()))
    counted.add(logits, labels)
    error = abs(counted.auc() - auc(logits, labels))
    assert error > TOLERANCE and counted.auc_error_bound() >= error


def test_the_parts_of_a_split_summed_are_the_whole() -> None:
    logits, labels = _scores("spread")
    whole, parts = ScoreHistogram(), [ScoreHistogram() for _ in range(3)]
    whole.add(logits, labels)
    for part, rows in zip(parts, torch.tensor_split(torch.arange(logits.numel()), 3), strict=True):
        part.add(logits[rows], labels[rows])
    summed = ScoreHistogram(0.0, sum((part.totals for part in parts), torch.zeros_like(whole.totals)))
    assert torch.equal(summed.totals[: 2 * BINS], whole.totals[: 2 * BINS])  # counts: exact
    assert summed.auc() == whole.auc() and summed.logloss() == pytest.approx(whole.logloss(), rel=1e-12)


@pytest.mark.parametrize("center", [0.0, -1.2, 1e-3])
def test_the_bins_keep_the_logits_order(center: float) -> None:
    edges = [-3e38, -256.0, -255.9, -1.0, -2.0**-16, -1e-30, -0.0, 0.0, 1e-30, 2.0**-16, 1e-3, 1.0, 255.9, 256.0, 3e38]
    spread = 10 ** (8 * torch.rand(50_000, dtype=torch.float64) - 6) * torch.sign(torch.randn(50_000))
    ordered = torch.sort(torch.cat([torch.tensor(edges), center + spread, torch.full((5,), center)]).float()).values
    bins = logit_bins(ordered, center)
    assert bins.min() >= 0 and bins.max() < BINS
    assert bool((bins[1:] >= bins[:-1]).all())  # monotone
    assert bool((bins[1:] == bins[:-1])[ordered[1:] == ordered[:-1]].all())  # ties share a bin


def test_a_bin_spans_2_to_the_minus_12_of_its_distance_from_the_center() -> None:
    assert logit_bins(torch.tensor([1.0, 1.0 + 2.0**-13])).unique().numel() == 1
    assert logit_bins(torch.tensor([1.0, 1.0 + 2.0**-12])).unique().numel() == 2
    assert logit_bins(torch.tensor([-1.2, -1.2 + 1e-7]), center=-1.2).unique().numel() == 2  # crowded: told apart
    assert logit_bins(torch.tensor([-0.0, 0.0, 1e-30, -1e-30])).unique().numel() == 1  # within 2**-24: the center's


def test_auc_needs_both_classes() -> None:
    counted = ScoreHistogram()
    counted.add(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="2 positives and 0 negatives"):
        counted.auc()


def test_eval_shares_are_even_contiguous_and_cover_the_rows() -> None:
    for rows in (0, 1, 5, 3001):
        for world in (1, 2, 3, 8):
            shares = [eval_share(rows, rank, world) for rank in range(world)]
            assert shares[0][0] == 0 and shares[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
            sizes = [stop - start for start, stop in shares]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank 2 of 2"):
        eval_share(10, 2, 2)


# ---------------------------------------------------------------- 2. ranks combined, one process's figures
def _trained_task() -> RecTask:
    """The same task on every process: seeded init, then a few steps so the model ranks something."""
    torch.manual_seed(0)
    task = build_task(DLRMConfig(bottom_mlp=[16], top_mlp=[16]), DATA, 1, micro_batches=1)
    optimizer = torch.optim.Adam(task.model.parameters(), lr=3e-3)
    for step in range(20):
        optimizer.zero_grad()
        task.loss(task.model, task.train_batch(step, 0, task.global_batch_size, CPU)).backward()
        optimizer.step()
    return task


def _evaluate_counting_rows(task: RecTask, max_rows: Optional[int]) -> dict[str, Any]:
    seen: list[int] = []
    hook = task.model.register_forward_hook(lambda module, args, out: seen.append(int(out.shape[0])))
    try:
        metrics = task.evaluate(task.model, CPU, max_rows)
    finally:
        hook.remove()
    return {"metrics": metrics, "rows_read": sum(seen)}


def _rank_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        assert collectives.rank_and_world() == (rank, 2)
        task = _trained_task()
        record = {"whole": _evaluate_counting_rows(task, None), "capped": _evaluate_counting_rows(task, 1001)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def test_two_ranks_combined_equal_one_process(tmp_path: Path) -> None:
    mp.spawn(_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    task = _trained_task()
    alone = _evaluate_counting_rows(task, None)
    assert alone["rows_read"] == 1024 + 3001
    with torch.no_grad():
        task.model.eval()
        split = next(task.data.eval_batches(batch_size=3001))
        logits = task.model(split.dense, split.sparse)
    # rank 0 also reads the first 1024 rows (or all, if fewer), whose mean logit centres the bins
    for name, rows, shares in (("whole", 3001, [1024 + 1500, 1501]), ("capped", 1001, [1001 + 500, 501])):
        exact_auc, exact_logloss = auc(logits[:rows], split.label[:rows]), logloss(logits[:rows], split.label[:rows])
        assert ranks[0][name]["metrics"] == ranks[1][name]["metrics"]  # every rank: the same numbers
        assert [r[name]["rows_read"] for r in ranks] == shares  # each read its share, no more
        combined = ranks[0][name]["metrics"]
        assert combined["eval_rows"] == rows
        assert abs(combined["auc"] - exact_auc) < TOLERANCE and abs(combined["logloss"] - exact_logloss) < TOLERANCE
        assert 0.55 < combined["auc"] < 0.99  # the model learned something: the ranking is worth comparing
    assert ranks[0]["whole"]["metrics"] == pytest.approx(alone["metrics"], abs=1e-12)  # whatever the world size


def test_a_crowded_eval_warns_that_its_auc_may_be_off(caplog: pytest.LogCaptureFixture) -> None:
    task = _trained_task()
    with torch.no_grad():  # every logit within 1e-4 of 1.2, in the order the model gave them
        last = task.model.top[-1]
        last.weight.mul_(1e-6)
        last.bias.fill_(1.2)
    with caplog.at_level(logging.WARNING, logger="jobs.rec.task"):
        task.evaluate(task.model, CPU)
    assert "may be off the exact figure by up to" in caplog.text


# ---------------------------------------------------------------- 3. the trainer: periodic evals capped
def test_periodic_evals_read_eval_max_rows_and_the_final_eval_all(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "resources.procs_per_node=2",
                  "trainer.max_steps=8", "trainer.eval_every=3", "trainer.eval_max_rows=333")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert [(r["step"], r["eval_rows"]) for r in evals] == [(3, 333), (6, 333), (8, 2048)]
    result = read_result(run_dir)
    assert result["eval_rows"] == 2048 and result["auc"] == evals[-1]["auc"] and 0.0 < result["auc"] < 1.0
