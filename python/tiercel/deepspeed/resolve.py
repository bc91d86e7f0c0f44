"""Finding the step a DeepSpeed load means: with no tag, the newest step that every rank can
restore, all of one save, and that holds a checkpoint of the load directory; with a tag, the
newest such step holding that tag. Collective: `Store.latest_step`'s own routine
(tiercel.kit.agree), asked to pass over steps without such a checkpoint.

Also the lookups that need no other rank: a step's layout, a tag in the steps this process
can see (for `export` and for loads outside `load_checkpoint`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .. import kit
from ..coordinator import Coordinator, LocalCoordinator, agree
from ..errors import InvalidArgumentError, NotFoundError, TiercelError
from ..step import Reader
from ..step_view import StepView
from ..store import Store
from .layout import LAYOUT_PUT, Layout, Save, norm_dir, tag_step


@dataclass
class Found:
    """The checkpoint a load reads: its step, the step's merged layout, the DeepSpeed save
    in it, and (from load_checkpoint) what the ranks agreed on: the save of the step, by
    generation, that every rank reads."""

    step: int
    layout: Layout
    save: Save
    agreed: kit.Agreement | None = None


def layout_of(reader: Reader) -> Layout:
    """One rank's DeepSpeed layout of a committed step, from its reader."""
    if LAYOUT_PUT not in reader.manifest.trees:
        raise NotFoundError(f"step {reader.step} was not saved through tiercel's DeepSpeed engine "
                            f"(it holds {', '.join(reader.manifest.trees) or 'nothing'})")
    return Layout.from_tree(reader.get(LAYOUT_PUT), f"step {reader.step} rank {reader.rank}")


def read_layout(store: Store, step: int, rank: int | None = None) -> Layout:
    """One rank's DeepSpeed layout of a committed step (default: this rank's)."""
    return layout_of(Reader(store, step, rank, trust_pickles=True))


def merged_layout(store: Store, step: int, view: StepView | None = None) -> Layout:
    """The step's layout with every rank's files, read from every rank's manifest by this
    process alone (export, and loads outside load_checkpoint), through `view` if given (its
    readers stay open for the files)."""
    view = view if view is not None else StepView(store, step, trust_pickles=True)
    return Layout.merge([layout_of(view.reader(r)) for r in range(view.world_size)], f"step {step}")


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


def coordinator_of(store: Store) -> Coordinator:
    """The store's coordinator, for the collectives of loading (tiercel.coordinator's cheap
    ones where only a combined answer is needed)."""
    if store.coordinator is None and store.world_size == 1:
        return LocalCoordinator()
    if store.coordinator is None:
        raise InvalidArgumentError("loading a DeepSpeed checkpoint with several ranks needs torch.distributed "
                                   "initialized before tiercel.deepspeed.attach()")
    return store.coordinator


def _merged(step: int, layouts: list[tuple[dict | None, str]]) -> tuple[str | None, dict | None]:
    """Every rank's layout of `step` merged into one (as a tree), or why they cannot be: a
    combine of the ranks' layouts that one rank runs and hands to all (`coordinator.agree`)."""
    if any(tree is None for tree, _ in layouts):
        return "; ".join(f"rank {r}: {why}" for r, (tree, why) in enumerate(layouts) if tree is None), None
    try:
        merged = Layout.merge([Layout.from_tree(tree, f"step {step} rank {r}") for r, (tree, _) in enumerate(layouts)],
                              f"step {step}")
    except TiercelError as e:
        return str(e), None
    return None, merged.to_tree()


def _own_layout(store: Store, step: int) -> tuple[dict | None, str]:
    """This rank's layout of a step (as a tree, to send), or None and why not."""
    try:
        return read_layout(store, step).to_tree(), ""
    except TiercelError as e:
        return None, str(e)


def resolve(store: Store, load_dir: str, tag: str | None) -> tuple[Found | None, list[str]]:
    """The checkpoint `load_checkpoint(load_dir, tag)` loads, agreed by every rank, or None
    and, per step passed over, why. Collective: the step is the one tiercel.kit.agree picks
    (the newest this job's ranks can all restore, all of one save of it: never a step saved
    again on some ranks only), among those whose ranks' layouts, exchanged, hold a checkpoint
    of `load_dir` (and `tag`)."""
    want = norm_dir(load_dir)
    fixed = tag_step(tag) if tag is not None else None
    found: list[Found] = []

    def holds(step: int) -> str | None:
        """Why `step` holds no such checkpoint, or None (and `found` has it); the same on
        every rank: it decides on every rank's layout, merged once by one rank."""
        why, tree = agree(coordinator_of(store), _own_layout(store, step), functools.partial(_merged, step))
        if why is not None:
            return why
        layout = Layout.from_tree(tree, f"step {step}")
        saves = layout.checkpoints(want, tag)
        if not saves:
            return f"it holds {layout.describe()}"
        found.append(Found(step, layout, saves[-1]))
        return None

    agreed = kit.agree(store, kit.Need(), only=None if fixed is None else (lambda s: s == fixed), accept=holds)
    if agreed.step is None:
        return None, agreed.skipped
    hit = found[-1]
    hit.agreed = agreed
    return hit, agreed.skipped


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
