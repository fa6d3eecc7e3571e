"""ModelSpec: the shape of the KV cache a node serves.

Pure data (dtype by name) so the coordinator, which never imports torch, can
carry and compare specs. A node serves exactly one spec; a request made for
another is refused with SpecMismatch. `model` names the weights: two models of
one shape (a base model and its fine-tune) compute different K/V for the same
tokens, so a node that names its model serves no other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import InvalidArgument, SpecMismatch

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MODEL_ID_MAX = 256


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    block_size: int = 16
    model: str = ""  # the weights' identity, e.g. "org/name@revision"; "" = not named

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(f"ModelSpec.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.model, str) or len(self.model) > MODEL_ID_MAX or not self.model.isprintable():
            raise InvalidArgument(
                f"ModelSpec.model must be printable text of at most {MODEL_ID_MAX} characters, "
                f"got {self.model!r}"
            )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for_bytes(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block

    def to_dict(self) -> dict:
        return asdict(self)

    def check_same(self, other: ModelSpec) -> None:
        """Raise SpecMismatch naming every field that differs."""
        if other != self:
            diffs = [
                f"{k}: {getattr(other, k)!r} != {getattr(self, k)!r}"
                for k in self.to_dict()
                if getattr(other, k) != getattr(self, k)
            ]
            raise SpecMismatch("model spec mismatch (request vs node): " + ", ".join(diffs))
