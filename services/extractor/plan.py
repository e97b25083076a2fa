"""What an extract job writes, decided before any forward pass: the samples (conversations rendered under the
job's policies), the forward batches, and the batches each shard holds. Every process of a job computes the same
plan from the same inputs, so N processes, each writing its share of the shards, write exactly the shards one
process would: one features artifact whatever the number of GPUs.

Policies (counted in the manifest):
  - a sample longer than max_length is truncated (policy "truncate", default) or skipped ("skip");
  - a conversation whose assistant turns are all empty, or a sample with no supervised token, is skipped;
  - a conversation no server renders as recorded (e.g. reasoning generated with thinking off) is skipped and
    counted, and the first reason logged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from eyas.features import shard_file_bytes
from eyas.render import RenderError, render_conversation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    id: str  # the conversation's id, "#n" added for its n-th sample after the first
    input_ids: list[int]
    loss_mask: list[int]


Batch = list[Item]  # right-padded into one forward pass of ≤ batch_tokens padded tokens


@dataclass
class Plan:
    shards: list[list[Batch]]  # shard i (shard_name(i)) holds these batches' samples, in this order
    counts: dict[str, int]  # the manifest's counts (policies, samples, tokens; "shards")

    @property
    def samples(self) -> list[Item]:
        """Every sample in the order the artifact stores them (shard by shard, batch by batch)."""
        return [item for shard in self.shards for batch in shard for item in batch]


def render_items(records: list[dict], tokenizer, template_kwargs: dict, max_length: int,
                 overlong: str) -> tuple[list[Item], dict[str, int]]:
    """The samples of the conversations (one per group of assistant turns that share the context the server saw,
    eyas.render) under the policies, and what the policies did."""
    counts = {"conversations": len(records), "truncated": 0, "skipped_overlong": 0, "skipped_empty": 0,
              "skipped_unrenderable": 0, "split_conversations": 0}
    items = []
    for rec in records:
        if not any((m.get("content") or m.get("reasoning_content") or m.get("reasoning")) for m in rec["messages"]
                   if m["role"] == "assistant"):
            counts["skipped_empty"] += 1
            continue
        try:
            rendered = render_conversation(tokenizer, rec["messages"], template_kwargs)
        except RenderError as e:
            if not counts["skipped_unrenderable"]:
                log.warning("conversation %s skipped: %s", rec["id"], e)
            counts["skipped_unrenderable"] += 1
            continue
        counts["split_conversations"] += len(rendered) > 1
        for n, r in enumerate(rendered):
            ids, mask = r.input_ids, r.loss_mask
            if len(ids) > max_length:
                if overlong == "skip":
                    counts["skipped_overlong"] += 1
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
                counts["truncated"] += 1
            if sum(mask) == 0:
                counts["skipped_empty"] += 1
                continue
            items.append(Item(rec["id"] if n == 0 else f"{rec['id']}#{n}", ids, mask))
    return items, counts


def batches(items: list[Item], batch_tokens: int) -> list[Batch]:
    """Group by length (longest first; a stable sort, so the same order in every process) so padding stays small;
    each batch ≤ batch_tokens padded tokens."""
    out: list[Batch] = []
    for item in sorted(items, key=lambda x: -len(x.input_ids)):
        if out and len(out[-1][0].input_ids) * (len(out[-1]) + 1) <= batch_tokens:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def shards(planned: list[Batch], row: int, max_bytes: int) -> list[list[Batch]]:
    """Consecutive batches per shard, each shard file at most `max_bytes` (`row` bytes per token, aux + final
    states, id and mask: eyas.features.token_bytes): a shard closes before the sample that would pass it, splitting a
    forward batch there into two (each
    part still longest first); a sample bigger than `max_bytes` on its own gets a shard of its own, with a warning."""
    out: list[list[Batch]] = []
    tokens = samples = 0  # in the open shard, out[-1]
    for batch in planned:
        part: Batch = []
        for item in batch:
            n = len(item.input_ids)
            if not out or (samples and shard_file_bytes(tokens + n, samples + 1, row) > max_bytes):
                if part:
                    out[-1].append(part)
                out.append([])
                part, tokens, samples = [], 0, 0
            if shard_file_bytes(n, 1, row) > max_bytes:
                log.warning("sample %s takes %.2f MiB of features, more than shard_mb (%.2f MiB): a shard of its own",
                            item.id, shard_file_bytes(n, 1, row) / (1 << 20), max_bytes / (1 << 20))
            part.append(item)
            tokens, samples = tokens + n, samples + 1
        if part:
            out[-1].append(part)
    return out


def make_plan(records: list[dict], tokenizer, template_kwargs: dict, *, max_length: int, overlong: str,
              batch_tokens: int, row: int, shard_max_bytes: int) -> Plan:
    items, counts = render_items(records, tokenizer, template_kwargs, max_length, overlong)
    planned = shards(batches(items, batch_tokens), row, shard_max_bytes)
    counts.update(samples=len(items), tokens=sum(len(i.input_ids) for i in items),
                  supervised_tokens=sum(sum(i.loss_mask) for i in items), shards=len(planned),
                  # samples larger than shard_mb on their own: each in a shard of its own, past the bound (warned)
                  samples_over_shard_mb=sum(shard_file_bytes(len(i.input_ids), 1, row) > shard_max_bytes
                                            for i in items))
    return Plan(shards=planned, counts=counts)
