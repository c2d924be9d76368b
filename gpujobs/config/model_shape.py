"""What a memory plan needs to know of a model, without building it (torch-free): its embedding tables and
the count of its other ("dense") parameters.

A job's model config describes its shape (`ModelShape`) from the config alone, so that submit and
`gpujobs plan` can tell whether the model fits the GPUs before anything is queued: a replicated (DDP) model
needs every table on every rank, a sharded one (TorchRec) spreads them over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes of one fp32 value: parameters, gradients and optimizer state are fp32 here.
FP32_BYTES = 4


@dataclass(frozen=True)
class Table:
    """One embedding table: `rows` vectors of `dim` values, looked up by the categorical feature `feature`."""

    name: str
    feature: str
    rows: int
    dim: int

    @property
    def parameters(self) -> int:
        return self.rows * self.dim


@dataclass(frozen=True)
class ModelShape:
    """A model's embedding tables and the parameters of everything else (MLPs, cross layers)."""

    tables: tuple[Table, ...]
    dense_parameters: int

    @property
    def table_parameters(self) -> int:
        return sum(table.parameters for table in self.tables)

    @property
    def parameters(self) -> int:
        """Every parameter of the model."""
        return self.table_parameters + self.dense_parameters
