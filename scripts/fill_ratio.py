"""Fill ratio (real tokens / token slots trained) of the documented hf path with mixed lengths: prompts of 8 to 128
tokens from a random-weight tiny target, streamed by ``python -m draftpipe_client.hf --batch-size 8`` into a
stream pipeline with ``batch_tokens`` 512, the ratio read from the run's ``summary.json``.

    [PROMPTS=800] [BUCKETS=16,32,...,128] python scripts/fill_ratio.py DRAFTPIPE_BIN CLIENT_DIR WORKDIR new

``CLIENT_DIR`` is a ``clients/python`` checkout; ``old`` runs a client from before the target's precision was
named ``--model-dtype`` (commit 59c54a2 and earlier), to measure the "before" figure against that build.
"""
import json, os, random, subprocess, sys
from pathlib import Path

binary, client, work, flavour = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
sys.path.insert(0, str(Path(client)))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python" / "tests"))
from conftest import write_pipe  # noqa: E402
from test_hf import tiny_model, WORDS  # noqa: E402

work.mkdir(parents=True, exist_ok=True)
vocab = tiny_model(work / "model")
rng = random.Random(5)
lengths = [rng.randint(8, 128) for _ in range(int(os.environ.get("PROMPTS", "160")))]
with open(work / "prompts.jsonl", "w") as out:
    for i, n in enumerate(lengths):
        out.write(json.dumps({"text": " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(n))}) + "\n")
buckets = tuple(int(b) for b in os.environ.get("BUCKETS", "32,64,96,128").split(","))
sock = work / "hs.sock"
pipe = write_pipe(work / "fill.pipe", f'stream(listen = "unix:{sock}")', hidden=16, taps=(1, 3), vocab=vocab,
                  batch_tokens=512, buckets=buckets)
run = subprocess.Popen([binary, "run", str(pipe), "--run-dir", str(work / "run")], stdout=subprocess.DEVNULL,
                       stderr=open(work / "run.err", "w"), env=dict(os.environ, MATMUL_NUM_THREADS="1"))
dtype = ["--dtype", "float32"] if flavour == "old" else ["--model-dtype", "float32"]
env = dict(os.environ, PYTHONPATH=client)
hf = subprocess.run([sys.executable, "-m", "draftpipe_client.hf", "--model", str(work / "model"), "--data",
                     str(work / "prompts.jsonl"), "--tap-layers", "1", "3", "--connect", f"unix:{sock}",
                     "--batch-size", "8", *dtype], env=env, capture_output=True, text=True)
assert hf.returncode == 0, hf.stderr
assert run.wait(300) == 0
summary = json.loads((work / "run" / "summary.json").read_text())
real = sum(lengths)
bound = sum(next(b for b in buckets if n <= b) for n in lengths)
slots = summary["token_slots"] if "token_slots" in summary else summary["tokens"]
print(f"{flavour}: {real} real tokens / {slots} slots = {real / slots:.3f}"
      f" over {summary['steps']} steps (rows' own buckets: {bound} slots, {real / bound:.3f})")
