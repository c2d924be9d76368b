"""The rec job's models (DLRM, DLRM-DCNv2), their shapes, and the task object the generic trainer drives."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpujobs.config.model_shape import ModelShape, Table
from jobs.rec.config import DCNv2Config, DLRMConfig, RecModelConfig, SyntheticClicksConfig
from jobs.rec.data import FeatureSpec
from jobs.rec.dcnv2 import DCNv2
from jobs.rec.model import DLRM, EmbeddingTables, RecModel
from jobs.rec.task import RecTask, build_task

REPO = Path(__file__).resolve().parent.parent

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


# --- the sparse arch and the dense rest -------------------------------------------------------------------

MODELS = [
    pytest.param(DLRMConfig(bottom_mlp=[8], top_mlp=[8]), id="dlrm-dot"),
    pytest.param(DLRMConfig(bottom_mlp=[8, 4], top_mlp=[], interaction="cat"), id="dlrm-cat"),
    pytest.param(DCNv2Config(bottom_mlp=[8], top_mlp=[8], cross_layers=2, low_rank=3), id="dcnv2"),
    pytest.param(DCNv2Config(embedding_dim=4, bottom_mlp=[], top_mlp=[16, 8, 4], cross_layers=1, low_rank=40),
                 id="dcnv2-rank-above-width"),
]


@pytest.mark.parametrize("cfg", MODELS)
def test_forward_is_the_sparse_arch_then_the_dense_rest(cfg: RecModelConfig) -> None:
    """What a sharded model swaps (`embeddings`) is all that touches the indices: its output [B, S, d] and the
    dense features give the logits through `forward_embedded`, whatever computes that output."""
    torch.manual_seed(0)
    model = cfg.build(FEATURES)
    assert isinstance(model, RecModel) and isinstance(model.embeddings, EmbeddingTables)
    dense, sparse = _inputs(5)
    embedded = model.embeddings(sparse)
    assert embedded.shape == (5, len(FEATURES.cardinalities), cfg.embedding_dim)
    logits = model(dense, sparse)
    assert logits.shape == (5,) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    torch.testing.assert_close(model.forward_embedded(dense, embedded), logits, rtol=0, atol=0)
    logits.sum().backward()  # every parameter is reachable from the logit
    assert all(p.grad is not None for p in model.parameters())
    # the tables' state-dict keys are DLRM's as they were before the sparse arch had a module of its own
    tables = [key for key in model.state_dict() if key.startswith("embeddings.")]
    assert tables == [f"embeddings.{i}.weight" for i in range(len(FEATURES.cardinalities))]


def test_dcnv2_cross_layers_compute_the_low_rank_cross() -> None:
    """x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l over the F vectors concatenated (dense vector first), ReLU after
    the bottom MLP as in TorchRec's DenseArch, then the top MLP."""
    torch.manual_seed(0)
    model = DCNv2Config(embedding_dim=4, bottom_mlp=[6], top_mlp=[5], cross_layers=2, low_rank=3).build(FEATURES)
    assert isinstance(model, DCNv2)
    for layer in model.cross:  # a bias of zero at the start would not tell b's place
        nn.init.normal_(layer.up.bias)
    dense, sparse = _inputs(7)
    embedded = model.embeddings(sparse)
    x0 = torch.cat([torch.relu(model.bottom[:-1](dense)), embedded.flatten(1)], dim=1)
    assert x0.shape == (7, (1 + 3) * 4)
    x = x0
    for layer in model.cross:
        x = x0 * (x @ layer.down.weight.T @ layer.up.weight.T + layer.up.bias) + x
    torch.testing.assert_close(model(dense, sparse), model.top(x).squeeze(1))
    assert [tuple(layer.down.weight.shape) for layer in model.cross] == [(3, 16), (3, 16)]


def test_dcnv2_learns_the_synthetic_log() -> None:
    """150 Adam steps of 64 rows: most of the oracle's lift over chance (the model reaches ~0.69 of 0.72)."""
    torch.manual_seed(0)
    cfg = DCNv2Config(embedding_dim=8, bottom_mlp=[16], top_mlp=[16], cross_layers=2, low_rank=8)
    task = build_task(cfg, SMALL_DATA, 1, micro_batches=1)
    untrained = task.evaluate(task.model, CPU)["auc"]
    optimizer = torch.optim.Adam(task.model.parameters(), lr=3e-3)
    for step in range(150):
        loss = task.loss(task.model, task.train_batch(step, 0, 64, CPU))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    metrics = task.evaluate(task.model, CPU)
    lift = (metrics["auc"] - 0.5) / (metrics["oracle_auc"] - 0.5)
    assert lift > 0.75 and metrics["auc"] > untrained + 0.05, (metrics, untrained)


# --- shapes, torch-free --------------------------------------------------------------------------------


def _counted(model: nn.Module) -> tuple[list[tuple[int, int]], int]:
    """The built model's tables (rows, dim) in order, and the count of its other parameters."""
    assert isinstance(model, RecModel)
    tables = [(table.num_embeddings, table.embedding_dim) for table in model.embeddings
              if isinstance(table, nn.Embedding)]
    others = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embeddings."))
    return tables, others


SHAPED = [
    *MODELS,
    pytest.param(DLRMConfig(), id="dlrm-defaults"),
    pytest.param(DCNv2Config(), id="dcnv2-defaults"),
    pytest.param(DCNv2Config(embedding_dim=5, bottom_mlp=[7, 3], top_mlp=[9, 2], cross_layers=4, low_rank=1),
                 id="dcnv2-odd"),
]


@pytest.mark.parametrize("features", [FEATURES, FeatureSpec(13, (2, 1000, 5) * 8 + (3, 4))], ids=["3-tables", "26"])
@pytest.mark.parametrize("cfg", SHAPED)
def test_shape_counts_what_build_makes(cfg: RecModelConfig, features: FeatureSpec) -> None:
    shape = cfg.shape(features)
    tables, others = _counted(cfg.build(features))
    assert [(t.rows, t.dim) for t in shape.tables] == tables
    assert shape.dense_parameters == others
    assert shape.parameters == sum(p.numel() for p in cfg.build(features).parameters())
    assert shape.tables[0] == Table("t_0", "f_0", features.cardinalities[0], cfg.embedding_dim)
    assert [t.feature for t in shape.tables] == [f"f_{i}" for i in range(len(features.cardinalities))]


def test_dcnv2_shape_by_hand() -> None:
    """F = 4 vectors of 4 = 16 values: bottom 4->6->4, 2 cross layers of 16x3 + 3x16 + 16, top 16->5->1."""
    cfg = DCNv2Config(embedding_dim=4, bottom_mlp=[6], top_mlp=[5], cross_layers=2, low_rank=3)
    bottom, cross, top = (4 * 6 + 6) + (6 * 4 + 4), 2 * (16 * 3 + 3 * 16 + 16), (16 * 5 + 5) + (5 + 1)
    tables = (Table("t_0", "f_0", 30, 4), Table("t_1", "f_1", 7, 4), Table("t_2", "f_2", 12, 4))
    assert cfg.shape(FEATURES) == ModelShape(tables=tables, dense_parameters=bottom + cross + top)


def test_shapes_are_computed_without_torch() -> None:
    code = ("import sys; from jobs.rec.config import DCNv2Config, DLRMConfig, CriteoConfig;"
            "features = CriteoConfig(store='/s', hash_buckets=list(range(1, 27))).features();"
            "DCNv2Config().shape(features); DLRMConfig(interaction='cat').shape(features);"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_dcnv2_config_refuses_what_it_cannot_build() -> None:
    for changes, key in (({"cross_layers": 0}, "cross_layers"), ({"low_rank": 0}, "low_rank"),
                         ({"top_mlp": [8, 0]}, "top_mlp"), ({"embedding_lr_scale": 0.0}, "embedding_lr_scale")):
        with pytest.raises(ValueError, match=f"^{key}=.* is invalid: allowed "):
            dataclasses.replace(DCNv2Config(), **changes)
