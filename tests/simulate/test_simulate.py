"""The simulator against schedules worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import cluster, costs, graph

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.simulate.simulator import execution_order, lower_bound_s, simulate

FWD = {"a": 1.0, "b": 2.0, "c": 3.0}
BWD = {"a": 2.0, "b": 4.0, "c": 6.0}


class TestChain:
    def test_one_device_is_the_sum_of_all_work(self, chain3):
        cl = cluster(1)
        plan = Plan.single(chain3, "d:0")
        pred = simulate(chain3, plan, costs(chain3, cl, FWD, BWD))
        assert pred.step_s == pytest.approx(18.0)
        assert pred.busy_s == {"d:0": pytest.approx(18.0)}
        assert pred.transfer_bytes == 0
        assert pred.bottleneck == "d:0"
        # forward in order, then backward in reverse order
        kinds = [(iv.kind, iv.label) for iv in pred.timeline if iv.lane == "compute"]
        assert kinds == [("fwd", "a"), ("fwd", "b"), ("fwd", "c"),
                         ("bwd", "c"), ("bwd", "b"), ("bwd", "a")]

    def test_two_devices_wait_for_transfers(self, chain3):
        # a on d:0; b, c on d:1. Link: 0.5 s latency + 100 B / 100 B/s = 1.5 s per transfer.
        cl = cluster(2, latency_s=0.5, bandwidth=100.0)
        plan = Plan.from_assignment(chain3, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "c": 1})
        pred = simulate(chain3, plan, costs(chain3, cl, FWD, BWD))
        # fa 1 + send 1.5 + fb 2 + fc 3 + bc 6 + bb 4 + grad back 1.5 + ba 2 = 21
        assert pred.step_s == pytest.approx(21.0)
        assert pred.busy_s["d:0"] == pytest.approx(3.0)
        assert pred.busy_s["d:1"] == pytest.approx(15.0)
        assert pred.transfer_bytes == 200  # activation forward + gradient back
        assert pred.bottleneck == "d:1"
        assert pred.critical_path[0] == "fwd a"
        assert pred.critical_path[-1] == "bwd a"

    def test_each_message_costs_both_ends_processor_time(self, chain3):
        # as above, with 0.25 s of processor time per tensor at each end: a's forward sends,
        # b's forward receives; b's backward sends the gradient, a's backward receives it
        cl = cluster(2, latency_s=0.5, bandwidth=100.0)
        plan = Plan.from_assignment(chain3, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "c": 1})
        pred = simulate(chain3, plan, replace(costs(chain3, cl, FWD, BWD), message_s=0.25))
        assert pred.step_s == pytest.approx(21.0 + 4 * 0.25)
        assert pred.busy_s["d:0"] == pytest.approx(3.0 + 2 * 0.25)
        assert pred.busy_s["d:1"] == pytest.approx(15.0 + 2 * 0.25)
        ends = {(iv.kind, iv.label): iv.end_s - iv.start_s for iv in pred.timeline
                if iv.lane == "compute"}
        assert ends[("fwd", "a")] == pytest.approx(1.25)
        assert ends[("fwd", "b")] == pytest.approx(2.25)
        assert ends[("bwd", "b")] == pytest.approx(4.25)
        assert ends[("bwd", "a")] == pytest.approx(2.25)
        assert ends[("fwd", "c")] == pytest.approx(3.0)

    def test_lower_bound_holds_when_a_split_batch_is_cheaper_per_sample(self, chain3):
        # measured: b takes 2 s at the whole batch, 0.8 s at half (1.6 s per batch), 0.7 s
        # at a quarter; data-parallel on 2 devices runs it at half, so the bound must use 1.6
        cl = cluster(2)
        cm = costs(chain3, cl, FWD, {}, overhead_s=0.5)
        dc = next(iter(cm.per_type.values()))
        names = [n.name for n in chain3.nodes]
        dc.fractions = [0.5, 0.25]
        dc.fwd_at = [[{"a": 0.5, "b": 0.8, "c": 1.5}.get(n, 0.0) for n in names],
                     [{"a": 0.25, "b": 0.7, "c": 0.75}.get(n, 0.0) for n in names]]
        dc.bwd_at = [[0.0] * len(names), [0.0] * len(names)]
        # per batch: a min(1, 1, 1) = 1; b min(2, 1.6, 2.8) = 1.6 (below a quarter its time
        # falls 0.4 s per batch, never to the 0.5 s floor: more per sample); c min(3, 3, 3)
        assert lower_bound_s(chain3, cm) == pytest.approx((1 + 1.6 + 3) / 2)
        plan = Plan.from_assignment(chain3, [tuple(cl.ids)], {"a": 0, "b": 0, "c": 0})
        pred = simulate(chain3, plan, cm)
        assert pred.step_s >= pred.lower_bound_s

    def test_lower_bound_where_the_time_meets_its_floor(self, chain3):
        # c: 3 s, 1.4 s at half, 0.6 s at a quarter; below that the time falls 3.2 s per batch
        # to the 0.3 s floor, reached at f = 0.25 - 0.3 / 3.2 = 0.15625: 0.3 / f = 1.92 s per
        # batch, less than any measured fraction gives (3, 2.8, 2.4)
        cl = cluster(1)
        cm = costs(chain3, cl, {"c": 3.0}, {}, overhead_s=0.3)
        dc = next(iter(cm.per_type.values()))
        dc.fractions = [0.5, 0.25]
        dc.fwd_at = [[0.0, 0.0, 0.0, 1.4], [0.0, 0.0, 0.0, 0.6]]
        dc.bwd_at = [[0.0] * 4, [0.0] * 4]
        assert lower_bound_s(chain3, cm) == pytest.approx(1.92)
        for m in range(1, 12):  # whatever the micro-batches, a step is no faster
            plan = Plan.single(chain3, "d:0", micro_batches=m)
            assert simulate(chain3, plan, cm).step_s >= 1.92 - 1e-9

    def test_lower_bound_is_compute_over_devices(self, chain3):
        cl = cluster(3)
        assert lower_bound_s(chain3, costs(chain3, cl, FWD, BWD)) == pytest.approx(18.0 / 3)


class TestForkJoin:
    def test_branches_run_in_parallel(self):
        g = graph([("x", "input", [], 10), ("s", "op", ["x"], 10), ("l", "op", ["s"], 10),
                   ("r", "op", ["s"], 10), ("j", "op", ["l", "r"], 4)])
        cl = cluster(2, latency_s=1.0)
        f = {"s": 1.0, "l": 4.0, "r": 4.0, "j": 1.0}
        b = {"s": 1.0, "l": 4.0, "r": 4.0, "j": 1.0}
        plan = Plan.from_assignment(g, [("d:0",), ("d:1",)], {"s": 0, "l": 0, "r": 1, "j": 0})
        pred = simulate(g, plan, costs(g, cl, f, b))
        # forward: s [0,1]; l on d0 [1,5]; s->d1 [1,2], r [2,6], r->d0 [6,7], j [7,8]
        # backward: bj [8,9]; grad->d1 [9,10], br [10,14]; bl on d0 [9,13];
        # grad r->d0 [14,15]; bs [15,16]
        assert pred.step_s == pytest.approx(16.0)
        one = simulate(g, Plan.single(g, "d:0"), costs(g, cl, f, b))
        assert one.step_s == pytest.approx(20.0)


class TestPipeline:
    @pytest.fixture
    def two_stages(self):
        g = graph([("x", "input", [], 80), ("a", "op", ["x"], 80, 0, ["x", "a"]),
                   ("b", "op", ["a"], 80, 0, ["a"]), ("loss", "op", ["b"], 4)])
        # per micro-batch (M=4, no fixed overhead): a and b take 1 s forward, 2 s backward
        return g, {"a": 4.0, "b": 4.0}, {"a": 8.0, "b": 8.0}

    @pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
    def test_bubble_is_stages_minus_one(self, two_stages, schedule):
        g, f, b = two_stages
        cl = cluster(2)
        plan = Plan.from_assignment(g, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "loss": 1},
                                    micro_batches=4, schedule=schedule)
        pred = simulate(g, plan, costs(g, cl, f, b))
        # (M + S - 1) x (f + b) per micro-batch = 5 x 3
        assert pred.step_s == pytest.approx(15.0)

    def test_1f1b_keeps_fewer_micro_batches_in_flight(self, two_stages):
        g, f, b = two_stages
        cl = cluster(2)
        peaks = {}
        for schedule in ("gpipe", "1f1b"):
            plan = Plan.from_assignment(g, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "loss": 1},
                                        micro_batches=4, schedule=schedule)
            pred = simulate(g, plan, costs(g, cl, f, b))
            peaks[schedule] = pred.memory["d:0"].activations_bytes
        # stage 0 keeps x and a's output (saved by a) per micro-batch, 20 B each at M=4, and
        # a received gradient (20 B) during a backward: GPipe holds all 4 micro-batches,
        # 1F1B at most 2
        assert peaks["gpipe"] >= 4 * 20 * 2
        assert peaks["1f1b"] <= 2 * 20 * 2 + 20
        assert peaks["1f1b"] < peaks["gpipe"]

    def test_more_micro_batches_shrink_the_bubble(self, two_stages):
        g, f, b = two_stages
        cl = cluster(2)
        steps = []
        for m in (1, 2, 4):
            plan = Plan.from_assignment(g, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "loss": 1},
                                        micro_batches=m)
            steps.append(simulate(g, plan, costs(g, cl, f, b)).step_s)
        assert steps == pytest.approx([24.0, 18.0, 15.0])  # (M+1)/M x 12


class TestLateReceive:
    """A message sent before its receive is posted, while its sender computes, waits
    ``Link.late_receive_s`` after the post (gloo between CPU ranks with no spare core)."""

    @staticmethod
    def _pipeline(wait: float, schedule: str = "gpipe", second_consumer: bool = False):
        # per micro-batch (M=4) a takes 0.6 s forward and 1 s backward on d:0, b 1 s forward
        # and 2 s backward on d:1; links are free. With a second consumer, c (no cost, on
        # d:1 after b) reads a's output too: the one transfer of it, received by b.
        spec = [("x", "input", [], 80), ("a", "op", ["x"], 80, 0, ["x", "a"]),
                ("b", "op", ["a"], 80, 0, ["a"])]
        if second_consumer:
            spec += [("c", "op", ["a", "b"], 80), ("loss", "op", ["c"], 4)]
        else:
            spec += [("loss", "op", ["b"], 4)]
        g = graph(spec)
        cl = cluster(2)
        cl = replace(cl, default_link=replace(cl.default_link, late_receive_s=wait))
        placement = {"a": 0, "b": 1, "loss": 1} | ({"c": 1} if second_consumer else {})
        plan = Plan.from_assignment(g, [("d:0",), ("d:1",)], placement, micro_batches=4,
                                    schedule=schedule)
        return g, plan, costs(g, cl, {"a": 2.4, "b": 4.0}, {"a": 4.0, "b": 8.0})

    @staticmethod
    def _starts(pred, device: str, kind: str) -> list[float]:
        return [iv.start_s for iv in pred.timeline
                if iv.device == device and iv.lane == "compute" and iv.kind == kind
                and iv.label in ("a", "b")]

    @pytest.mark.parametrize("second_consumer", [False, True])
    def test_only_a_receive_posted_after_the_send_while_the_sender_computes_waits(
            self, second_consumer):
        # (c, where it reads a's output too, starts after b received it: no wait of its own)
        g, plan, cm = self._pipeline(0.0, second_consumer=second_consumer)
        pred = simulate(g, plan, cm)
        # fa m at [0.6m, 0.6m + 0.6]; fb m at [0.6 + m, 1.6 + m]; then 4 x (2 + 1)
        assert self._starts(pred, "d:1", "fwd") == pytest.approx([0.6, 1.6, 2.6, 3.6])
        assert pred.step_s == pytest.approx(13.6)
        g, plan, cm = self._pipeline(0.25, second_consumer=second_consumer)
        pred = simulate(g, plan, cm)
        # fb 0: d:1 was waiting when a's output was sent (at 0.6), so it arrives at once.
        # fb 1: sent at 1.2, posted at 1.6 while fa 2 computes [1.2, 1.8]: waits to 1.85.
        # fb 2: sent at 1.8, posted at 2.85, d:0 idle since 2.4 (waiting for gradients): no
        # wait. The gradients go back to d:0, which waits for each: no wait either.
        assert self._starts(pred, "d:1", "fwd") == pytest.approx([0.6, 1.85, 2.85, 3.85])
        assert pred.step_s == pytest.approx(13.85)
        assert pred.busy_s == pytest.approx(simulate(*self._pipeline(0.0)).busy_s)
        # as if every rank had a core to spare: no wait
        on_time = replace(cm, cluster=cm.cluster.without_late_receive())
        assert simulate(g, plan, on_time).step_s == pytest.approx(13.6)
        assert "send a[1]" in pred.critical_path

    def test_the_runtime_follows_the_schedule_with_the_waits(self):
        g, plan, cm = self._pipeline(0.25, "1f1b")
        pred = simulate(g, plan, cm)
        order = execution_order(g, plan, cm)
        for s, dev in enumerate(("d:0", "d:1")):
            ivs = sorted((iv for iv in pred.timeline if iv.device == dev
                          and iv.lane == "compute" and iv.kind in ("fwd", "bwd")),
                         key=lambda iv: (iv.start_s, iv.end_s))
            assert [(iv.kind, iv.micro_batch, iv.label) for iv in ivs] == \
                [(k, m, g.nodes[i].name) for k, m, i in order[s] if k != "optimizer"]


class TestDataParallel:
    def test_allreduce_after_backward(self):
        g = graph([("x", "input", [], 64), ("w", "param", [], 1000),
                   ("a", "op", ["x", "w"], 64), ("loss", "op", ["a"], 4)])
        cl = cluster(2, latency_s=0.25, bandwidth=1000.0)
        c = costs(g, cl, {"a": 4.0, "loss": 0.0}, {"a": 8.0, "loss": 0.0})
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {"a": 0, "loss": 0})
        pred = simulate(g, plan, c)
        # each replica: fwd 2 + bwd 4; ring all-reduce of 1000 B over 2 devices:
        # 2(k-1) x 0.25 s + 2(k-1)/k x 1000 B / 1000 B/s = 0.5 + 1.0
        assert pred.step_s == pytest.approx(7.5)
        assert pred.allreduce_bytes == 2000
        assert pred.busy_s == {"d:0": pytest.approx(6.0), "d:1": pytest.approx(6.0)}
        assert pred.memory["d:0"].params_bytes == 1000
        assert pred.memory["d:0"].grads_bytes == 1000
        assert pred.memory["d:0"].optimizer_bytes == 2000  # Adam: two moments

    @pytest.mark.parametrize("replicas, lag", [(2, 0.6), (4, 0.3 * 1.0294 / 0.5642)])
    def test_the_all_reduce_waits_for_replicas_that_wander_apart(self, replicas, lag):
        # as above, with each replica's busy time wandering 10 % past the replicas' mean on
        # two ranks (DeviceCosts.replica_spread): the all-reduce also waits 10 % of the
        # stage's busy time, scaled for more replicas as E[max of k normals] / E[max of 2]
        # (0.5642 and 1.0294); the busy time itself is unchanged
        g = graph([("x", "input", [], 64), ("w", "param", [], 1000),
                   ("a", "op", ["x", "w"], 64), ("loss", "op", ["a"], 4)])
        cl = cluster(replicas, latency_s=0.25, bandwidth=1000.0)
        c = costs(g, cl, {"a": 4.0, "loss": 0.0}, {"a": 8.0, "loss": 0.0})
        plan = Plan.from_assignment(g, [cl.ids], {"a": 0, "loss": 0})
        flat = simulate(g, plan, c)
        busy = 12.0 / replicas
        assert flat.busy_s[cl.ids[0]] == pytest.approx(busy)
        for dc in c.per_type.values():
            dc.replica_spread = 0.1
        pred = simulate(g, plan, c)
        assert pred.step_s == pytest.approx(flat.step_s + lag)
        assert pred.busy_s == flat.busy_s
        assert simulate(g, plan, c.without_contention()).step_s == pytest.approx(flat.step_s)
        # a stage on one device has nothing to wait for
        single = replace(plan, stages=((cl.ids[0],),))
        assert simulate(g, single, c).step_s == pytest.approx(simulate(
            g, single, c.without_contention()).step_s)

    def test_fixed_overhead_does_not_shrink(self):
        g = graph([("x", "input", [], 64), ("a", "op", ["x"], 64)])
        cl = cluster(4)
        c = costs(g, cl, {"a": 4.0}, {"a": 0.0}, overhead_s=1.0)
        plan = Plan.from_assignment(g, [cl.ids], {"a": 0})
        assert simulate(g, plan, c).step_s == pytest.approx(1.0 + 3.0 / 4)


class TestMemory:
    def test_saved_activations_live_until_backward(self):
        g = graph([("x", "input", [], 100), ("w", "param", [], 40),
                   ("a", "op", ["x", "w"], 200, 0, ["x"]),
                   ("b", "op", ["a"], 300, 0, ["b"]), ("loss", "op", ["b"], 4)])
        cl = cluster(1)
        c = costs(g, cl, {"a": 1.0, "b": 1.0, "loss": 1.0}, {"a": 1.0, "b": 1.0, "loss": 1.0})
        pred = simulate(g, Plan.single(g, "d:0", optimizer="sgd"), c)
        m = pred.memory["d:0"]
        # w's gradient appears with a's backward [5,6), after the peak: none at the peak
        assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (40, 0, 0)
        # fa [0,1] fb [1,2] floss [2,3] bloss [3,4] bb [4,5] ba [5,6]. Live: x [0,6] (saved
        # by a), a [0,2], b [1,5] (saved by b), loss [2,4], grad b [3,5], grad a [4,5].
        # Peak in [4,5): x 100 + b 300 + grad b 300 + grad a 200 = 900
        assert m.activations_bytes == 900
        assert pred.peak_bytes["d:0"] == 940

    @pytest.mark.parametrize("micro_batches", [1, 2])
    def test_an_ops_backward_scratch_is_held_while_that_backward_runs(self, micro_batches):
        # the same graph as above, b's backward passing 250 bytes between its own autograd
        # nodes (at the whole batch): held in [4,5) beside the peak's 900, each micro-batch
        # its share; a's (50) in [5,6), after the peak
        g = graph([("x", "input", [], 100), ("w", "param", [], 40),
                   ("a", "op", ["x", "w"], 200, 0, ["x"]),
                   ("b", "op", ["a"], 300, 0, ["b"]), ("loss", "op", ["b"], 4)])
        g.nodes[3] = replace(g.nodes[3], backward_scratch_bytes=250)
        g.nodes[2] = replace(g.nodes[2], backward_scratch_bytes=50)
        cl = cluster(1)
        c = costs(g, cl, {"a": 1.0, "b": 1.0, "loss": 1.0}, {"a": 1.0, "b": 1.0, "loss": 1.0})
        plan = Plan.single(g, "d:0", optimizer="sgd", micro_batches=micro_batches)
        none = OpGraph(g.name, [replace(n, backward_scratch_bytes=0) for n in g.nodes],
                       g.batch_size)
        with_scratch = simulate(g, plan, c).memory["d:0"].activations_bytes
        assert with_scratch == simulate(none, plan, c).memory["d:0"].activations_bytes \
            + 250 // micro_batches
        if micro_batches == 1:
            assert with_scratch == 900 + 250

    def test_library_workspaces_count_on_every_device_that_has_them(self):
        """A GPU's cuBLAS workspaces, measured at profile time, are held for the whole run."""
        g = graph([("x", "input", [], 100), ("w", "param", [], 40),
                   ("a", "op", ["x", "w"], 200, 0, ["x"]), ("loss", "op", ["a"], 4)])
        cl = cluster(1)
        c = costs(g, cl, {"a": 1.0, "loss": 1.0}, {"a": 1.0, "loss": 1.0})
        plain = simulate(g, Plan.single(g, "d:0", optimizer="sgd"), c)
        key = cl.devices[0].type_key
        held = replace(c, per_type={key: replace(c.per_type[key], workspace_bytes=32 << 20)})
        pred = simulate(g, Plan.single(g, "d:0", optimizer="sgd"), held)
        assert pred.memory["d:0"].workspace_bytes == 32 << 20
        assert pred.peak_bytes["d:0"] == plain.peak_bytes["d:0"] + (32 << 20)
        assert plain.memory["d:0"].workspace_bytes == 0

    def test_over_memory_is_reported_with_the_device(self):
        g = graph([("x", "input", [], 100), ("w", "param", [], 10_000),
                   ("a", "op", ["x", "w"], 100)])
        cl = cluster(1, memory=1000)
        pred = simulate(g, Plan.single(g, "d:0"), costs(g, cl, {"a": 1.0}, {"a": 1.0}))
        assert not pred.fits
        assert "d:0" in pred.over_memory_bytes
        assert "d:0 needs" in pred.memory_report()

    def test_many_devices_over_memory_are_counted_and_the_worst_named(self):
        g = graph([("x", "input", [], 100), ("w", "param", [], 10_000),
                   ("a", "op", ["x", "w"], 100)])
        cl = cluster(8, memory=1000)
        pred = simulate(g, Plan.from_assignment(g, [cl.ids], {"a": 0}),
                        costs(g, cl, {"a": 1.0}, {"a": 1.0}))
        assert len(pred.over_memory_bytes) == 8
        report = pred.memory_report()
        assert report.startswith("8 devices do not fit; the most, d:0, needs ")
        assert report.count("needs") == 1


class TestRefusals:
    def test_plan_for_another_graph_is_refused(self, chain3):
        other = graph([("x", "input", [], 100), ("a", "op", ["x"], 100)], name="other")
        plan = Plan.single(other, "d:0")
        with pytest.raises(PlanError, match="made for graph other"):
            simulate(chain3, plan, costs(chain3, cluster(1), FWD, BWD))

    def test_unknown_device_is_refused(self, chain3):
        plan = Plan.single(chain3, "gpu:7")
        with pytest.raises(PlanError, match="gpu:7"):
            simulate(chain3, plan, costs(chain3, cluster(1), FWD, BWD))


class TestContention:
    """Replicas on CPU ranks of one host slow each other, running the same ops at the same
    moment (DeviceCosts.contention)."""

    @staticmethod
    def _contended(g, cl, ratio: float):
        cm = costs(g, cl, FWD, BWD)
        for dc in cm.per_type.values():
            dc.contention = [ratio if n.kind == "op" else 1.0 for n in g.nodes]
        return cm

    @staticmethod
    def _branches():
        """a on d:0 and b on d:1 both read x; c = f(a, b) on d:1."""
        g = graph([("x", "input", [], 100), ("a", "op", ["x"], 100), ("b", "op", ["x"], 100),
                   ("c", "op", ["a", "b"], 4)])
        return g, Plan.from_assignment(g, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "c": 1})

    def test_a_sequential_plan_is_unchanged(self, chain3):
        # a on d:0, then b, c on d:1: never both computing
        cl = cluster(2)
        plan = Plan.from_assignment(chain3, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "c": 1})
        pred = simulate(chain3, plan, self._contended(chain3, cl, 2.0))
        assert pred.step_s == pytest.approx(18.0)
        assert pred.busy_s == {"d:0": pytest.approx(3.0), "d:1": pytest.approx(15.0)}

    def test_replicas_always_compute_together(self, chain3):
        # data-parallel: each replica runs every op on half the batch (9 s) while the other
        # does the same, so every op takes 1.5 x
        cl = cluster(2)
        plan = Plan.from_assignment(chain3, [("d:0", "d:1")], {"a": 0, "b": 0, "c": 0})
        assert simulate(chain3, plan, costs(chain3, cl, FWD, BWD)).step_s == pytest.approx(9.0)
        pred = simulate(chain3, plan, self._contended(chain3, cl, 1.5))
        assert pred.step_s == pytest.approx(13.5)
        assert pred.busy_s == {"d:0": pytest.approx(13.5), "d:1": pytest.approx(13.5)}

    def test_different_stages_computing_at_once_are_not_slowed(self):
        # fa [0,1] with fb [0,2]; fc [2,5]; bc [5,11]; then bb [11,15] with ba [11,13]: the
        # two ranks compute at once, but different ops, so contention 2 changes nothing
        g, plan = self._branches()
        cl = cluster(2)
        assert simulate(g, plan, costs(g, cl, FWD, BWD)).step_s == pytest.approx(15.0)
        pred = simulate(g, plan, self._contended(g, cl, 2.0))
        assert pred.step_s == pytest.approx(15.0)
        assert pred.busy_s == {"d:0": pytest.approx(3.0), "d:1": pytest.approx(15.0)}

    def test_only_the_replicas_slow_each_other(self, chain3):
        # a, b on two replicas (half the batch each), c on d:2. With contention 2 the
        # replicas' ops take 2 x (fa 1, fb 2, bb 4, ba 2), c's do not (fc 3, bc 6): 18 s
        cl = cluster(3)
        plan = Plan.from_assignment(chain3, [("d:0", "d:1"), ("d:2",)],
                                    {"a": 0, "b": 0, "c": 1})
        assert simulate(chain3, plan, costs(chain3, cl, FWD, BWD)).step_s == pytest.approx(13.5)
        pred = simulate(chain3, plan, self._contended(chain3, cl, 2.0))
        assert pred.step_s == pytest.approx(18.0)
        assert pred.busy_s == {"d:0": pytest.approx(9.0), "d:1": pytest.approx(9.0),
                               "d:2": pytest.approx(9.0)}

    def test_a_tensor_group_is_not_slowed_by_the_replicas_figure(self, chain3):
        # contention is measured between data-parallel replicas (whole weights, half the
        # batch each); a tensor group's ranks run different shards, and what they add to
        # each other is the split run's (DeviceCosts.dtensor). Two devices split 2 ways:
        # none of it; 4 devices as 2 replicas x 2: the replicas slow each other
        for n, ratio in ((2, 1.0), (4, 1.5)):
            cl = cluster(n)
            plan = Plan.from_assignment(chain3, [tuple(cl.ids)], {"a": 0, "b": 0, "c": 0})
            plan = plan.with_tensor(2)
            cm = self._contended(chain3, cl, 1.5)
            flat = simulate(chain3, plan, cm.without_contention())
            assert simulate(chain3, plan, cm).step_s == pytest.approx(flat.step_s * ratio)

    def test_replicas_step_their_optimizers_together(self):
        # a on x with weight w (1000 bytes, Adam 0.004 s per byte: a 4 s step). Two replicas
        # step every parameter at the same moment: measured 1.25 x slower beside each
        # other, their steps take 5 s; one device alone, or two stages, step as measured
        g = graph([("x", "input", [], 64), ("w", "param", [], 1000),
                   ("a", "op", ["x", "w"], 64), ("loss", "op", ["a"], 4)])
        cl = cluster(2)
        c = costs(g, cl, {"a": 4.0, "loss": 1.0}, {"a": 8.0, "loss": 1.0},
                  opt_per_byte=0.004)
        for dc in c.per_type.values():
            dc.contention = [1.0] * len(g)
        dp = Plan.from_assignment(g, [cl.ids], {"a": 0, "loss": 0})
        flat = simulate(g, dp, c)
        assert flat.step_s == pytest.approx(7.0 + 4.0)
        for dc in c.per_type.values():
            dc.optimizer_contention = 1.25
        pred = simulate(g, dp, c)
        assert pred.step_s == pytest.approx(7.0 + 5.0)
        assert pred.busy_s == {d: pytest.approx(12.0) for d in cl.ids}
        assert simulate(g, dp, c.without_contention()).step_s == pytest.approx(11.0)
        single = replace(dp, stages=((cl.ids[0],),))
        assert simulate(g, single, c).step_s == pytest.approx(14.0 + 4.0)
        two = Plan.from_assignment(g, [("d:0",), ("d:1",)], {"a": 0, "loss": 1})
        assert simulate(g, two, c).busy_s["d:0"] == pytest.approx(12.0 + 4.0)

    def test_the_lower_bound_ignores_it(self, chain3):
        cl = cluster(2)
        plan = Plan.from_assignment(chain3, [("d:0", "d:1")], {"a": 0, "b": 0, "c": 0})
        pred = simulate(chain3, plan, self._contended(chain3, cl, 1.5))
        assert pred.lower_bound_s == pytest.approx(9.0)

    def test_the_runtime_follows_the_contended_schedule(self):
        # the ranks run the tasks in the order the prediction (and its memory) assumes
        g, plan = self._branches()
        cm = self._contended(g, cluster(2), 2.0)
        pred = simulate(g, plan, cm)
        for s, dev in enumerate(("d:0", "d:1")):
            shown = [(iv.kind, iv.label) for iv in sorted(pred.timeline, key=lambda iv: (
                iv.start_s, iv.end_s)) if iv.device == dev and iv.kind in ("fwd", "bwd")]
            assert [(k, g.nodes[i].name) for k, _, i in execution_order(g, plan, cm)[s]
                    if k in ("fwd", "bwd")] == shown
