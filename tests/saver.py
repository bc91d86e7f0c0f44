"""The trainer loop that the kill tests kill (tests/test_kill.py, tests/chaos/chaos.py): a
single process that, as a restarted trainer does, restores the newest step it can, then
saves step after step, one save in flight behind the current one. It prints "ready <step>"
before its first save and "saved <step>" after each save() returned.

    python saver.py POLICY_JSON MODULE:FUNCTION [--nbytes N] [--flush-every N] [--wait S]

MODULE:FUNCTION makes a step's state from its number (and `nbytes`, when given): a function
of the step number only, so that a checker can rebuild every step. `--flush-every N` also
flushes every background tier after every Nth step (a kill point of its own)."""

from __future__ import annotations

import argparse
import importlib
import json

import tiercel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("policy")
    ap.add_argument("state")
    ap.add_argument("--nbytes", type=int)
    ap.add_argument("--flush-every", type=int, default=0)
    ap.add_argument("--wait", type=float, default=120.0, help="seconds a save's handle may take")
    a = ap.parse_args()
    module, func = a.state.split(":")
    make = getattr(importlib.import_module(module), func)

    def state(step: int):
        return make(step) if a.nbytes is None else make(step, a.nbytes)

    store = tiercel.Store(json.loads(a.policy), rank=0, world_size=1)
    newest = store.latest_step() or 0
    if newest:
        store.restore()  # a kill point too
    step = newest + 1
    print("ready", step, flush=True)
    previous = None
    while True:
        handle = store.save(step, state(step))
        print("saved", step, flush=True)
        if previous is not None:  # one save in flight behind the current one, as trainers do
            previous.wait(a.wait)
        previous = handle
        if a.flush_every and step % a.flush_every == 0:
            store.flush()
        step += 1


if __name__ == "__main__":
    main()
