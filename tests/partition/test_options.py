"""Partitioner options of the wrong type are refused before the partitioner runs, by name."""

from __future__ import annotations

import numpy as np
import pytest
from builders import cluster, costs

from explorer.core.errors import ExplorerError
from explorer.partition import algorithm, algorithms, partition
from explorer.partition.registry import checked_options


def _solve(chain3, name: str, **options):
    cl = cluster(2)
    return partition(chain3, cl, costs(chain3, cl, {"a": 1.0, "b": 1.0, "c": 1.0}, {}), name,
                     **options)


@pytest.mark.parametrize(("name", "options", "words"), [
    ("even-layers", {"k": "two"}, r"even-layers: option 'k' needs an int or None, got str "
                                  r"'two'; its default is None"),
    ("pipeline-dp", {"micro_batches": "x"}, r"pipeline-dp: option 'micro_batches' needs an "
                                             r"int or None, got str 'x'"),
    ("even-layers", {"micro_batches": 2.5}, r"'micro_batches' needs an int, got float 2\.5; "
                                             r"its default is 1"),
    ("data-parallel", {"k": True}, r"'k' needs an int or None, got bool True"),
    ("pase", {"compare_baselines": "yes"}, r"'compare_baselines' needs a bool, got str"),
    ("min-comm", {"tolerance": "0.1"}, r"'tolerance' needs a float, got str '0\.1'"),
    ("wap", {"algorithms": "pase"}, r"'algorithms' needs a list of str, got str 'pase'"),
    ("wap", {"algorithms": ["pase", 3]}, r"'algorithms' needs a list of str, got list"),
    ("single", {"device": 0}, r"single: option 'device' needs a str or None, got int 0"),
])
def test_wrong_type_is_named(chain3, name, options, words):
    with pytest.raises(ExplorerError, match=words):
        _solve(chain3, name, **options)


def test_right_types_pass(chain3):
    assert _solve(chain3, "even-layers", k=2, micro_batches=np.int64(2)).micro_batches == 2
    assert _solve(chain3, "data-parallel", k=None).stages
    checked_options(algorithm("min-comm"), {"tolerance": 1})  # an int is a fine float
    checked_options(algorithm("wap"), {"algorithms": ("data-parallel",)})


def test_every_default_passes_its_own_check():
    for name in algorithms():
        alg = algorithm(name)
        checked_options(alg, dict(alg.options))
