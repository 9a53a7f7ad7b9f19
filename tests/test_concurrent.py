"""Two processes ingesting overlapping sources into one store at once both succeed, with no duplicate."""

import json

from conftest import run_python

from storage.query import sql

CODE = """
import sys, time
from pathlib import Path
from storage.store import Store
from tasks.ingest import ingest_source
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.01)
s = ingest_source(Store(sys.argv[1]), sys.argv[2], source_name='shared')
print(s.new, s.already_present)
"""


def test_concurrent_ingest_no_duplicates(store, tmp_path):
    shared = [{"question": f"shared {i}?", "answer": i} for i in range(300)]
    for name, extra in (("a", range(100)), ("b", range(100, 200))):
        rows = shared + [{"question": f"own {i}?", "answer": i} for i in extra]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    go = tmp_path / "go"
    import subprocess

    procs = [
        run_python(CODE.replace("sys.argv[1]", repr(store.root)).replace("sys.argv[2]", repr(str(tmp_path / f"{n}.jsonl")))
                   .replace("sys.argv[3]", repr(str(go))), stdout=subprocess.PIPE, text=True)
        for n in ("a", "b")
    ]
    go.touch()
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    # one source name, so the 300 shared prompts have the same ids in both: 500 distinct in all
    landed = sorted((int(o[0]), int(o[1])) for o in outs)
    assert landed == [(100, 300), (400, 0)]
    rows = sql(store, "SELECT count(*) AS n, count(DISTINCT prompt_id) AS d FROM prompts").to_pylist()
    assert rows == [{"n": 500, "d": 500}]
