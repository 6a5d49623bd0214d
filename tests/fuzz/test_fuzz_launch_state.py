"""Fuzz what a run reads of its launch and of its run folder's tracker state, property-based.

``trackers.json`` (the tracker run ids a resume continues) is drawn as arbitrary bytes, JSON
of every kind, and objects whose ids are any text; ``read_ids`` returns an object of texts
whose W&B/MLflow ids are ids, or a LlamatrainError in one line. torchrun's variables
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) are drawn set,
unset or any text; ``rank()``/``world_size()`` and the rendezvous check give numbers in their
ranges or a LlamatrainError in one line, never int()'s ValueError — all within
``fuzz_bounds.bounded``'s bounds.
"""

from __future__ import annotations

import json

import pytest
from fuzz_bounds import bounded
from hypothesis import given
from hypothesis import strategies as st

from llamatrain import parallel
from llamatrain.trackers import IDS_FILE, RUN_ID, read_ids

pytestmark = pytest.mark.fuzz

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
ids_objects = st.dictionaries(
    st.sampled_from(["wandb", "mlflow", "tensorboard"]) | st.text(max_size=6),
    st.text(max_size=40) | st.sampled_from(["abc123", "0123456789abcdef" * 2, "", "../x"]),
    max_size=3,
).map(lambda d: json.dumps(d).encode())
contents = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    ids_objects,
    st.sampled_from([b"[" * 100_000, b'{"wandb": "' + b"a" * 70_000 + b'"}', b"\xef\xbb\xbf{}"]),
)


@given(contents)
def test_trackers_json_gives_ids_or_one_line(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("run") / IDS_FILE
    path.write_bytes(raw)
    ids = bounded(lambda: read_ids(path), "trackers.json")
    if ids is not None:
        assert isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values())
        assert all(RUN_ID.fullmatch(ids[k]) for k in ("wandb", "mlflow") if k in ids)


LAUNCH_VARS = ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
env_values = (
    st.none()
    | st.sampled_from(
        [
            "0",
            "1",
            "2",
            "3",
            "-1",
            "65535",
            "65536",
            "1e3",
            " 2",
            "0x10",
            "²",
            "٣",
            "9" * 5000,
            "",
            "abc",
        ]
    )
    | st.text(max_size=6)
)


@given(st.fixed_dictionaries({name: env_values for name in LAUNCH_VARS}))
def test_torchruns_variables_give_ranks_or_one_line(env):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            if value is None or "\0" in value:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        world = bounded(parallel.world_size, "WORLD_SIZE")
        rank = bounded(parallel.rank, "RANK")
        if world is not None and rank is not None:
            assert world >= 1 and 0 <= rank < world
        if not parallel.launched():
            assert (world, rank) == (1, 0)
            return
        address = bounded(parallel._rendezvous, "MASTER_ADDR/MASTER_PORT")
        assert address is None or address.rsplit(":", 1)[1].isdecimal()
