"""Captures from several threads (a notebook measuring in the background) take turns."""

from __future__ import annotations

import threading

import explorer as ex


def test_captures_in_two_threads_give_the_graph_one_alone_gives():
    bm = ex.builtin_model("gpt", "tiny")
    alone = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
    got: dict[str, object] = {}

    def run(fake: bool) -> None:
        try:
            got[str(fake)] = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                                        fake=fake)
        except Exception as e:  # reported below, with the thread's own error
            got[str(fake)] = e

    threads = [threading.Thread(target=run, args=(f,)) for f in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert {k: getattr(v, "fingerprint", v) for k, v in got.items()} == \
        {"True": alone.fingerprint, "False": alone.fingerprint}
