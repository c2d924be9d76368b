"""The rec job's model and the task object the generic trainer drives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobs.rec.config import DLRMConfig, SyntheticClicksConfig
from jobs.rec.data import FeatureSpec
from jobs.rec.model import DLRM
from jobs.rec.task import RecTask, build_task

FEATURES = FeatureSpec(num_dense=4, cardinalities=(30, 7, 12))
CPU = torch.device("cpu")
SMALL_DATA = SyntheticClicksConfig(
    num_train=4096, num_eval=2048, num_dense=4, cardinalities=[30, 7, 12], batch_size=64, num_interactions=1
)


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(batch, FEATURES.num_dense, generator=generator)
    sparse = torch.stack([torch.randint(0, n, (batch,), generator=generator) for n in FEATURES.cardinalities], 1)
    return dense, sparse


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_forward_gives_one_logit_per_sample(interaction: str) -> None:
    model = DLRMConfig(interaction=interaction, bottom_mlp=[8], top_mlp=[8]).build(FEATURES)
    logits = model(*_inputs(5))
    assert logits.shape == (5,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.sum().backward()  # every parameter is reachable from the logit
    assert all(p.grad is not None for p in model.parameters())


def test_model_has_no_buffers_for_ddp_to_broadcast() -> None:
    assert list(DLRMConfig().build(FEATURES).buffers()) == []


def test_initial_parameters_come_from_the_global_seed() -> None:
    def parameters(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return list(DLRMConfig().build(FEATURES).state_dict().values())

    first, again, other = parameters(0), parameters(0), parameters(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_embedding_lr_scale_keeps_the_function_and_shrinks_the_stored_rows() -> None:
    torch.manual_seed(0)
    plain = DLRMConfig(embedding_lr_scale=1.0).build(FEATURES)
    torch.manual_seed(0)
    scaled = DLRMConfig(embedding_lr_scale=8.0).build(FEATURES)
    assert isinstance(plain, DLRM) and isinstance(scaled, DLRM)
    for a, b in zip(plain.embeddings.parameters(), scaled.embeddings.parameters(), strict=True):
        torch.testing.assert_close(a / 8.0, b)
    torch.testing.assert_close(plain(*_inputs(6)), scaled(*_inputs(6)))


def _task(world_size: int = 1) -> RecTask:
    torch.manual_seed(0)
    return build_task(DLRMConfig(bottom_mlp=[16], top_mlp=[16]), SMALL_DATA, world_size, micro_batches=1)


def test_task_loss_is_mean_bce_and_decreases_with_training() -> None:
    task = _task()
    assert task.global_batch_size == 64
    optimizer = torch.optim.Adam(task.model.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        batch = task.train_batch(step, 0, 64, CPU)
        loss = task.loss(task.model, batch)
        if step == 0:
            expected = F.binary_cross_entropy_with_logits(task.model(batch.dense, batch.sparse), batch.label)
            torch.testing.assert_close(loss, expected)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.05


def test_evaluate_reports_metrics_and_restores_the_mode() -> None:
    task = _task()
    seen_modes: list[bool] = []
    task.model.register_forward_hook(lambda module, args, out: seen_modes.append(module.training))
    metrics = task.evaluate(task.model, CPU)
    assert set(metrics) == {"auc", "logloss", "eval_rows", "oracle_auc"}
    assert metrics["eval_rows"] == task.data.num_eval
    assert 0.0 <= metrics["auc"] <= 1.0 and metrics["logloss"] > 0.0
    assert metrics["oracle_auc"] == task.data.oracle_auc
    assert seen_modes and not any(seen_modes)
    assert task.model.training
    task.model.eval()
    task.evaluate(task.model, CPU)
    assert not task.model.training


def test_evaluate_reads_the_first_max_rows_eval_rows() -> None:
    task = _task()
    seen: list[int] = []
    task.model.register_forward_hook(lambda module, args, out: seen.append(int(out.shape[0])))
    # the first 100 rows, once more for the histogram's center
    assert task.evaluate(task.model, CPU, max_rows=100)["eval_rows"] == 100 and seen == [100, 100]
    assert task.evaluate(task.model, CPU, max_rows=10**9)["eval_rows"] == task.data.num_eval


def test_tasks_of_all_ranks_start_from_the_same_model_and_stream() -> None:
    first, second = _task(world_size=2), _task(world_size=2)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert first.global_batch_size == 128
    assert torch.equal(first.train_batch(0, 0, 64, CPU).dense, second.train_batch(0, 0, 64, CPU).dense)
    assert not torch.equal(first.train_batch(0, 0, 64, CPU).dense, second.train_batch(0, 64, 128, CPU).dense)
