"""Validated configuration of the tiered chunk-cache store.

Owns: ``StoreConfig`` — budgets, locations and switches of every tier, checked once. A
budget of 0 (or no location) leaves that tier out. Does not own: building the tiers
(``TieredStore.from_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StoreConfig(BaseModel):
    """Tiers, fastest first: gpu -> cpu -> disk -> redis. Budgets are hard byte limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$",
                           description="model fingerprint digest; entries of another namespace are foreign")
    gpu_bytes: int = Field(0, ge=0, description="GPU tier budget (tensor bytes); 0 = no GPU tier")
    gpu_device: str = Field("cuda", description="CUDA device of the GPU tier")
    cpu_bytes: int = Field(0, ge=0, description="host RAM tier budget (tensor bytes); 0 = no CPU tier")
    pin_memory: bool | None = Field(None, description="pin CPU-tier tensors; None = when CUDA is present")
    disk_dir: Path | None = Field(None, description="directory of the disk tier (local SSD); None = no disk tier")
    disk_bytes: int = Field(0, ge=0, description="disk tier budget in allocated bytes on disk")
    disk_validate: Literal["lazy", "header", "full"] = Field("header", description="file checks at start")
    disk_fsync: bool = Field(True, description="fsync files and directories on write (durable across crashes)")
    redis_url: str | None = Field(None, description="redis://host:port/db of the shared tier; None = no Redis tier")
    redis_bytes: int = Field(0, ge=0, description="Redis tier budget, shared by every process using the server")
    redis_ttl_s: float | None = Field(None, gt=0, description="expire Redis values after this many seconds")
    redis_prefix: str = Field("cachedrag", min_length=1, description="Redis key prefix (accounting spans it)")
    redis_timeout_s: float = Field(0.5, gt=0, description="socket (and connect) timeout of each Redis call")
    redis_breaker_failures: int = Field(2, ge=1, description="consecutive timeouts / connection errors that open "
                                        "the circuit (calls skipped: served from the other tiers)")
    redis_breaker_reset_s: float = Field(5.0, gt=0, description="how long the circuit stays open before a trial call")
    write_through: bool = Field(False, description="put also copies the entry into the persistent tiers (disk, redis)")
    prefetch_workers: int = Field(1, ge=1, le=64, description="background threads moving entries up for prefetch()")

    @model_validator(mode="after")
    def _consistent(self) -> StoreConfig:
        if self.disk_dir is not None and self.disk_bytes == 0:
            raise ValueError("disk_dir is set but disk_bytes is 0")
        if self.disk_bytes and self.disk_dir is None:
            raise ValueError("disk_bytes is set but disk_dir is not")
        if self.redis_url is not None and self.redis_bytes == 0:
            raise ValueError("redis_url is set but redis_bytes is 0")
        if self.redis_bytes and self.redis_url is None:
            raise ValueError("redis_bytes is set but redis_url is not")
        if not (self.gpu_bytes or self.cpu_bytes or self.disk_bytes or self.redis_bytes):
            raise ValueError("no tier configured: set at least one of gpu_bytes, cpu_bytes, disk_bytes, redis_bytes")
        return self
