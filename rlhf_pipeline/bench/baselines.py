"""Baseline backends for the storage benchmark: what one would build without our stores.

``raw-numpy`` (flat files, a Python loop to pad: the floor for writes, the reference for reads),
``raw-numpy-fsync`` (the same, fsynced after each batch), ``torchrl-lazystack`` (in RAM) and
``torchrl-lazymemmap`` (every row padded to the maximum). Each returns the same padded TensorDict as
:func:`rlhf_pipeline.schema.padding.pad_batch` (tested). Figures: docs/benchmarks.md#storage-rlhf-pipeline-bench-storage.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_pipeline.bench.storage_backends import BenchSpec, directory_bytes
from rlhf_pipeline.schema import TrajectoryBatch

PAD_TOKEN_ID = 0
_RESPONSE_FLOATS = {  # schema field -> (full key, response key), as in rlhf_pipeline.schema.padding
    "response_log_probs": (("log_probs", "full"), ("log_probs", "response")),
    "ref_log_probs": (("next", "ref_log_probs", "full"), ("ref_log_probs", "response")),
    "kl": (("kl", "full"), ("kl", "response")),
    "token_rewards": (("next", "token_reward", "full"), ("next", "token_reward", "response")),
}
_ROW_FIELDS = ("group_id", "trajectory_id", "step", "reward", "done", "terminated", "truncated",
               "policy_version", "advantage")


def assemble_from_padded(
    prompt_left: torch.Tensor,  # (B, P) left-padded prompt tokens
    response_right: torch.Tensor,  # (B, R) right-padded response tokens
    prompt_lengths: torch.Tensor,  # (B,)
    response_lengths: torch.Tensor,  # (B,)
    response_floats: dict[str, torch.Tensor],  # schema field -> (B, R) right-padded with 0
    rows: dict[str, torch.Tensor],  # schema row field -> (B,)
    index_dtype: torch.dtype = torch.int64,  # of the token ids and position_ids
) -> TensorDict:
    """The collator's output contract, built from already padded pieces."""
    num_rows, prompt_width = prompt_left.shape
    columns = torch.arange(prompt_width + response_right.shape[1])[None, :]
    prompt_lengths, response_lengths = prompt_lengths.to(torch.int64), response_lengths.to(torch.int64)
    prompt_start = (prompt_width - prompt_lengths)[:, None]
    response_end = (prompt_width + response_lengths)[:, None]
    attention_mask = (columns >= prompt_start) & (columns < response_end)
    assistant_mask = (columns >= prompt_width) & (columns < response_end)
    full_tokens = torch.cat([prompt_left.to(index_dtype), response_right.to(index_dtype)], dim=1)
    out = {
        ("tokens", "full"): full_tokens,
        ("tokens", "prompt"): full_tokens[:, :prompt_width],
        ("tokens", "response"): full_tokens[:, prompt_width:],
        ("masks", "all_attention_mask"): attention_mask,
        ("masks", "all_assistant_mask"): assistant_mask,
        ("masks", "prompt"): attention_mask[:, :prompt_width],
        ("masks", "response"): assistant_mask[:, prompt_width:],
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp_min(0).to(index_dtype),
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
    }
    for name, padded in response_floats.items():
        full_key, response_key = _RESPONSE_FLOATS[name]
        full = torch.cat([padded.new_zeros((num_rows, prompt_width)), padded.to(torch.float32)], dim=1)
        out[full_key] = full
        out[response_key] = full[:, prompt_width:]
    if "advantage" in rows:
        advantage = rows["advantage"].to(torch.float32)
        out["sequence_advantage"] = advantage
        out["advantage"] = (assistant_mask * advantage[:, None]).unsqueeze(-1)
    for name in ("reward", "done", "terminated", "truncated"):
        out[("next", name)] = rows[name].reshape(num_rows, 1)
    for name in ("group_id", "trajectory_id", "step", "policy_version"):
        out[name] = rows[name]
    return TensorDict(out, batch_size=[num_rows])


# =========================================================================== raw numpy
class RawNumpyBackend:
    """Flat values + offsets in numpy files; Python-loop gather and pad."""

    name = "raw-numpy"
    durable = False

    def setup(self, directory: Path, spec: BenchSpec) -> None:
        self._dir = directory
        self._spec = spec
        self._ragged = [f.name for f in spec.schema.fields if f.kind in ("token", "text")]
        self._rows = [f.name for f in spec.schema.fields if f.kind == "row"]
        self._files = {name: open(directory / f"{name}.bin", "ab") for name in self._ragged + self._rows}
        self._lengths: dict[str, list[np.ndarray]] = {name: [] for name in self._ragged}
        self._dtypes = {f.name: _numpy_dtype(f.dtype) for f in spec.schema.fields}

    def write(self, batch: TrajectoryBatch) -> None:
        for name in self._ragged:
            column = batch[name]
            if isinstance(column, list):
                encoded = [text.encode("utf-8") for text in column]
                np.frombuffer(b"".join(encoded), dtype=np.uint8).tofile(self._files[name])
                self._lengths[name].append(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
            else:
                column.values.numpy().tofile(self._files[name])
                self._lengths[name].append(column.lengths().numpy())
        for name in self._rows:
            batch[name].numpy().tofile(self._files[name])
        if self.durable:
            # the straightforward durable append: every file flushed and fsynced, one by one
            for handle in self._files.values():
                handle.flush()
                os.fsync(handle.fileno())

    def finish_writes(self) -> None:
        for name, handle in self._files.items():
            handle.close()
        self._offsets = {}
        for name in self._ragged:
            offsets = np.zeros(sum(len(x) for x in self._lengths[name]) + 1, dtype=np.int64)
            np.cumsum(np.concatenate(self._lengths[name]), out=offsets[1:])
            offsets.tofile(self._dir / f"{name}.offsets")
            self._offsets[name] = np.memmap(self._dir / f"{name}.offsets", dtype=np.int64, mode="r")
        self._values = {
            name: np.memmap(self._dir / f"{name}.bin", dtype=self._dtypes[name], mode="r")
            for name in self._ragged + self._rows
        }

    def sample_padded(self, positions: torch.Tensor) -> TensorDict:
        index = positions.numpy()
        prompt_off, response_off = self._offsets["prompt_tokens"], self._offsets["response_tokens"]
        prompt_lengths = prompt_off[index + 1] - prompt_off[index]
        response_lengths = response_off[index + 1] - response_off[index]
        prompt_width = int(prompt_lengths.max())
        width = prompt_width + int(response_lengths.max())
        num_rows = len(index)
        index_dtype = np.int32 if self._spec.index_dtype == "int32" else np.int64
        tokens = np.full((num_rows, width), PAD_TOKEN_ID, dtype=index_dtype)
        attention = np.zeros((num_rows, width), dtype=np.bool_)
        assistant = np.zeros((num_rows, width), dtype=np.bool_)
        position_ids = np.zeros((num_rows, width), dtype=index_dtype)
        float_names = [n for n in _RESPONSE_FLOATS if n in self._values]
        floats = {n: np.zeros((num_rows, width), dtype=np.float32) for n in float_names}
        has_advantage = "advantage" in self._values
        advantage = np.zeros((num_rows, width, 1), dtype=np.float32)
        prompt_values, response_values = self._values["prompt_tokens"], self._values["response_tokens"]
        # the straightforward loop: each row's slices copied into the padded arrays one by one
        for b, i in enumerate(index.tolist()):
            p_start, p_end = prompt_off[i], prompt_off[i + 1]
            r_start, r_end = response_off[i], response_off[i + 1]
            first, end = prompt_width - (p_end - p_start), prompt_width + (r_end - r_start)
            tokens[b, first:prompt_width] = prompt_values[p_start:p_end]
            tokens[b, prompt_width:end] = response_values[r_start:r_end]
            attention[b, first:end] = True
            assistant[b, prompt_width:end] = True
            position_ids[b, first:end] = np.arange(end - first)
            position_ids[b, end:] = end - first - 1
            for name in float_names:
                floats[name][b, prompt_width:end] = self._values[name][r_start:r_end]
            if has_advantage:
                advantage[b, prompt_width:end, 0] = self._values["advantage"][i]
        rows = {name: torch.from_numpy(np.asarray(self._values[name][index])) for name in self._rows}
        full_tokens, attention_t, assistant_t = map(torch.from_numpy, (tokens, attention, assistant))
        out = {
            ("tokens", "full"): full_tokens,
            ("tokens", "prompt"): full_tokens[:, :prompt_width],
            ("tokens", "response"): full_tokens[:, prompt_width:],
            ("masks", "all_attention_mask"): attention_t,
            ("masks", "all_assistant_mask"): assistant_t,
            ("masks", "prompt"): attention_t[:, :prompt_width],
            ("masks", "response"): assistant_t[:, prompt_width:],
            "position_ids": torch.from_numpy(position_ids),
            "prompt_lengths": torch.from_numpy(prompt_lengths),
            "response_lengths": torch.from_numpy(response_lengths),
        }
        for name in float_names:
            full_key, response_key = _RESPONSE_FLOATS[name]
            out[full_key] = torch.from_numpy(floats[name])
            out[response_key] = out[full_key][:, prompt_width:]
        if has_advantage:
            out["sequence_advantage"] = rows["advantage"]
            out["advantage"] = torch.from_numpy(advantage)
        for name in ("reward", "done", "terminated", "truncated"):
            out[("next", name)] = rows[name].reshape(num_rows, 1)
        for name in ("group_id", "trajectory_id", "step", "policy_version"):
            out[name] = rows[name]
        return TensorDict(out, batch_size=[num_rows])

    def disk_bytes(self) -> int:
        return directory_bytes(self._dir)

    def close(self) -> None:
        self._values = {}
        self._offsets = {}


class RawNumpyFsyncBackend(RawNumpyBackend):
    """``raw-numpy`` that fsyncs its files after every batch: the like-for-like baseline
    for stores that make each append durable."""

    name = "raw-numpy-fsync"
    durable = True


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


# =========================================================================== torchrl
class TorchRLLazyStackBackend:
    """torchrl ``LazyStackStorage``: ragged per-row TensorDicts, in RAM."""

    name = "torchrl-lazystack"

    def setup(self, directory: Path, spec: BenchSpec) -> None:
        from torchrl.data import LazyStackStorage, ReplayBuffer

        self._spec = spec
        self._buffer = ReplayBuffer(storage=LazyStackStorage(max_size=spec.completions))

    def write(self, batch: TrajectoryBatch) -> None:
        self._buffer.extend(batch.to_tensordict())

    def finish_writes(self) -> None:
        pass

    def sample_padded(self, positions: torch.Tensor) -> TensorDict:
        rows_td = self._buffer.storage.get(positions)  # lazy stack of ragged rows
        prompt_left = rows_td.get(("tokens", "prompt"), as_padded_tensor=True, padding_side="left",
                                  padding_value=PAD_TOKEN_ID)
        response_right = rows_td.get(("tokens", "response"), as_padded_tensor=True, padding_side="right",
                                     padding_value=PAD_TOKEN_ID)
        prompt_lengths = rows_td.get(("tokens", "prompt"), as_list=True)
        response_list = rows_td.get(("tokens", "response"), as_list=True)
        floats = {}
        for name in _RESPONSE_FLOATS:
            if name in self._spec.schema.field_names:
                key = _torchrl_key(name)
                floats[name] = rows_td.get(key, as_padded_tensor=True, padding_side="right", padding_value=0.0)
        rows = {}
        for name in _ROW_FIELDS:
            if name in self._spec.schema.field_names:
                rows[name] = rows_td.get(_torchrl_key(name)).reshape(-1)
        return assemble_from_padded(
            prompt_left, response_right,
            torch.tensor([t.numel() for t in prompt_lengths]), torch.tensor([t.numel() for t in response_list]),
            floats, rows, self._spec.torch_index_dtype,
        )

    def disk_bytes(self) -> int:
        return 0  # lives in RAM only: torchrl's LazyStackStorage cannot be persisted

    def close(self) -> None:
        self._buffer = None


class TorchRLLazyMemmapBackend:
    """torchrl ``LazyMemmapStorage``: every row padded to the maximum lengths, on disk."""

    name = "torchrl-lazymemmap"
    TEXT_WIDTH = 32  # bytes kept per text field; the synthetic texts are shorter

    def setup(self, directory: Path, spec: BenchSpec) -> None:
        from torchrl.data import LazyMemmapStorage, ReplayBuffer

        self._dir = directory
        self._spec = spec
        self._buffer = ReplayBuffer(
            storage=LazyMemmapStorage(max_size=spec.completions, scratch_dir=str(directory))
        )

    def write(self, batch: TrajectoryBatch) -> None:
        spec = self._spec
        dense = {
            "prompt_tokens": batch["prompt_tokens"].to_padded(PAD_TOKEN_ID, length=spec.max_prompt_len)[0],
            "prompt_lengths": batch["prompt_tokens"].lengths(),
            "response_lengths": batch["response_tokens"].lengths(),
        }
        for name in ("response_tokens", *_RESPONSE_FLOATS):
            if name in spec.schema.field_names:
                dense[name] = batch[name].to_padded(0, length=spec.max_response_len)[0]
        for name in _ROW_FIELDS:
            if name in spec.schema.field_names:
                dense[name] = batch[name]
        for name in ("prompt_text", "response_text"):
            dense[name] = _fixed_width_text(batch[name], self.TEXT_WIDTH)
        self._buffer.extend(TensorDict(dense, batch_size=[len(batch)]))

    def finish_writes(self) -> None:
        pass

    def sample_padded(self, positions: torch.Tensor) -> TensorDict:
        td = self._buffer.storage.get(positions)
        prompt_lengths, response_lengths = td["prompt_lengths"], td["response_lengths"]
        prompt_width, response_width = int(prompt_lengths.max()), int(response_lengths.max())
        # stored right-padded: shift each prompt to the right edge with one gather
        source = torch.arange(prompt_width)[None, :] - (prompt_width - prompt_lengths)[:, None]
        prompt = td["prompt_tokens"].gather(1, source.clamp_min(0))
        prompt_left = torch.where(source >= 0, prompt, PAD_TOKEN_ID)
        floats = {n: td[n][:, :response_width] for n in _RESPONSE_FLOATS if n in td.keys()}
        rows = {n: td[n] for n in _ROW_FIELDS if n in td.keys()}
        return assemble_from_padded(
            prompt_left, td["response_tokens"][:, :response_width], prompt_lengths, response_lengths, floats, rows,
            self._spec.torch_index_dtype,
        )

    def disk_bytes(self) -> int:
        return directory_bytes(self._dir)

    def close(self) -> None:
        self._buffer = None


def _fixed_width_text(texts: list[str], width: int) -> torch.Tensor:
    encoded = b"".join(t.encode("utf-8")[:width].ljust(width, b"\0") for t in texts)
    return torch.frombuffer(bytearray(encoded), dtype=torch.uint8).reshape(len(texts), width)


def _torchrl_key(name: str):
    from rlhf_pipeline.schema import FIELDS_BY_NAME

    return FIELDS_BY_NAME[name].torchrl_key
