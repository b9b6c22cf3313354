"""The search builds its Layouts without Layout's checks (`Layout.trusted`); every one it can build must pass them.

The shapes come straight from the enumeration, and the searched micro-batches,
recomputation levels and stage splits are filled in by `trusted_replace`: each
is rebuilt here through the checking constructor, which must accept it and give
an equal, equally hashed Layout.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.layout import Layout, divisors
from planner.model.load import load_model
from planner.search.candidates import Pins, offload_options, pipeline_allows, shapes
from planner.search.search import search
from topologies.cluster_load import load_cluster


def _checked(layout: Layout) -> Layout:
    return Layout(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(Layout)})


@pytest.mark.parametrize(("name", "gpus", "pins"), [
    ("13B", 64, Pins()),
    ("mixtral-8x7b", 64, Pins()),
    ("qwen3-30b-a3b", 128, Pins(offload="optimizer")),
    ("deepseek-v3", 256, Pins(pp_schedule="interleaved-1f1b")),
])
def test_every_enumerated_shape_passes_the_checks(name, gpus, pins):
    model = load_model(name)
    built = 0
    for shape in shapes(gpus, model, 4096, pins, offload_options(pins, ('none',), False)[0]):
        assert type(shape) is Layout
        checked = _checked(shape)
        assert checked == shape and hash(checked) == hash(shape)
        for mb in (1, 2):  # micro-batches the search fills in, where the pipeline allows them
            if pipeline_allows(shape, 8 // mb):
                leaf = shape.trusted_replace(micro_batch_size=mb, grad_accum_steps=8 // mb)
                assert _checked(leaf) == leaf == shape.replace(micro_batch_size=mb, grad_accum_steps=8 // mb)
        built += 1
    assert built > 0


@pytest.mark.parametrize(("name", "gpus", "engine"), [("13B", 16, "meshplan"), ("mixtral-8x7b", 64, "megatron"),
                                                       ("70B", 64, "megatron")])
def test_searched_layouts_pass_the_checks(name, gpus, engine):
    model = load_model(name)
    result = search(model, load_cluster("dgx-h100", gpus), 4096, engine=engine)
    assert result.ranked
    for scored in result.ranked:
        lay = scored.layout
        assert _checked(lay) == lay
        assert lay.grad_accum_steps * lay.micro_batch_size * lay.dp == scored.training.global_batch_size
        assert lay.micro_batch_size in divisors(scored.training.global_batch_size // lay.dp)
