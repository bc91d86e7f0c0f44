"""Finding the step a DeepSpeed load means: with no tag, the newest step that every rank can
restore from some tier and that holds a checkpoint of the load directory; with a tag, the
newest such step holding that tag. Collective (one all-gather per candidate step, usually
one), like `Store.latest_step`, of which this is the DeepSpeed-aware form.

Also the lookups that need no other rank: a step's layout, a tag in the steps this process
can see (for `export` and for loads outside `load_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, NotFoundError, TiercelError
from ..step import Reader
from ..store import Store
from .layout import LAYOUT_PUT, Layout, Save, norm_dir, tag_step


@dataclass
class Found:
    step: int
    layout: Layout
    save: Save


def read_layout(store: Store, step: int, rank: int | None = None) -> Layout:
    """One rank's DeepSpeed layout of a committed step (default: this rank's)."""
    reader = Reader(store, step, rank, trust_pickles=True)
    if LAYOUT_PUT not in reader.manifest.trees:
        raise NotFoundError(f"step {step} was not saved through tiercel's DeepSpeed engine "
                            f"(it holds {', '.join(reader.manifest.trees) or 'nothing'})")
    return Layout.from_tree(reader.get(LAYOUT_PUT), f"step {step} rank {reader.rank}")


def merged_layout(store: Store, step: int) -> Layout:
    """The step's layout with every rank's files, read from every rank's manifest by this
    process alone (export, and loads outside load_checkpoint)."""
    world = Reader(store, step, 0).manifest.world_size
    return Layout.merge([read_layout(store, step, r) for r in range(world)], f"step {step}")


def committed_steps(store: Store) -> list[int]:
    """Steps committed on any tier, as this process sees them, oldest first."""
    return sorted({s for steps in store.steps().values() for s in steps})


def may_hold_dir(store: Store, load_dir: str) -> bool:
    """Whether some step this process sees committed may hold a DeepSpeed save of
    `load_dir`: its own layout of the step records one, or the step cannot be opened to
    tell (then a load must say what is wrong, not start fresh). Not collective."""
    want = norm_dir(load_dir)
    for step in reversed(committed_steps(store)):
        try:
            reader = Reader(store, step, trust_pickles=True)
            if LAYOUT_PUT not in reader.manifest.trees:
                continue  # not saved through the DeepSpeed engine
            layout = Layout.from_tree(reader.get(LAYOUT_PUT), f"step {step} rank {reader.rank}")
        except TiercelError:
            return True
        if any(s.dir == want for s in layout.saves):
            return True
    return False


def tier_names(store: Store) -> list[str]:
    return [t["name"] for t in store.tiers()]


def gather(store: Store, value: Any) -> list[Any]:
    if store.world_size == 1:
        return [value]
    if store.coordinator is None:
        raise InvalidArgumentError("loading a DeepSpeed checkpoint with several ranks needs torch.distributed "
                                   "initialized before tiercel.deepspeed.attach()")
    return store.coordinator.all_gather(value)


def _own_layout(store: Store, step: int) -> tuple[dict | None, str]:
    """This rank's layout of a step (as a tree, to send), or None and why not."""
    try:
        return read_layout(store, step).to_tree(), ""
    except TiercelError as e:
        return None, str(e)


def resolve(store: Store, load_dir: str, tag: str | None) -> tuple[Found | None, list[str]]:
    """The checkpoint `load_checkpoint(load_dir, tag)` loads, agreed by every rank, or None
    and, per step tried, why not. Collective: the ranks exchange the steps they can open,
    then, newest first, their layouts of a candidate step (usually one round)."""
    want = norm_dir(load_dir)
    fixed = tag_step(tag) if tag is not None else None
    mine = [s for s in committed_steps(store) if fixed is None or s == fixed]
    everyone = gather(store, mine)
    common = sorted(set(everyone[0]).intersection(*map(set, everyone[1:])), reverse=True)
    notes: list[str] = []
    for step in common:
        layouts = gather(store, _own_layout(store, step))
        if any(tree is None for tree, _ in layouts):
            notes += [f"step {step}: rank {r}: {why}" for r, (tree, why) in enumerate(layouts) if tree is None]
            continue
        try:
            layout = Layout.merge([Layout.from_tree(tree, f"step {step} rank {r}") for r, (tree, _) in enumerate(layouts)],
                                  f"step {step}")
        except TiercelError as e:
            notes.append(str(e))
            continue
        saves = layout.checkpoints(want, tag)
        if saves:
            return Found(step, layout, saves[-1]), notes
        notes.append(f"step {step} holds {layout.describe()}")
    return None, notes


def not_found(store: Store, load_dir: str, tag: str | None, notes: list[str]) -> NotFoundError:
    """The error for a load that found nothing: what was asked, the tiers searched, what
    each step holds."""
    what = f"tag '{tag}'" if tag is not None else "a checkpoint"
    fixed = tag_step(tag) if tag is not None else None
    where = f" (step {fixed})" if fixed is not None else ""
    try:
        steps: Any = store.steps()
    except TiercelError as e:
        steps = f"cannot list: {e}"
    detail = "; ".join(notes[-8:]) or "no step is committed on every rank"
    return NotFoundError(
        f"DeepSpeed {what}{where} in {norm_dir(load_dir)}: no step that every rank can restore from tiers "
        f"{tier_names(store)} holds it (committed as this rank sees it: {steps}); {detail}"
    )


def find_local(store: Store, tag: str, load_dir: str | None = None, *, checkpoints_only: bool = True) -> Found:
    """The newest step this process can read that holds `tag` (in `load_dir` if given). Not
    collective: for a single process (export) or a file DeepSpeed loads on its own."""
    fixed = tag_step(tag)
    want = norm_dir(load_dir) if load_dir is not None else None
    seen = []
    for step in reversed(committed_steps(store)):
        if fixed is not None and step != fixed:
            continue
        try:
            layout = merged_layout(store, step)
        except TiercelError as e:
            seen.append(f"step {step}: {e}")
            continue
        saves = layout.checkpoints(want, tag) if checkpoints_only else [
            s for s in layout.saves if s.tag == tag and (want is None or s.dir == want)]
        if saves:
            return Found(step, layout, saves[-1])
        seen.append(f"step {step}: {layout.describe()}")
    raise not_found(store, load_dir or "any directory", tag, seen)
