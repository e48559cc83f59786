"""A producer process for the end-to-end tests: sends seeded random messages, logs each acknowledgement.

    python producer_proc.py ADDRESS NAME FIRST COUNT ACK_LOG [--hang-after K]

Sends messages FIRST..FIRST+COUNT (message m is seeded by (NAME, m), so a restarted producer sends the same
data), appends one line per acknowledgement to ACK_LOG (`message batches`), then says done. With
--hang-after K it stops after K acknowledgements and sleeps, so the test can kill it between messages.
"""

import argparse
import time
import zlib

import numpy as np

from draftpipe_client import Producer

HIDDEN, TAPS, VOCAB = 8, (0, 1), 64


def message(name, m):
    rng = np.random.default_rng([zlib.crc32(name.encode()), m])
    rows, seq = 3, 30
    lengths = rng.integers(4, seq + 1, rows)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.uint8)
    ids = rng.integers(0, VOCAB, (rows, seq))
    hs = rng.standard_normal((rows, seq, HIDDEN * len(TAPS))).astype(np.float32)
    return ids, hs, mask


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("name")
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("ack_log")
    parser.add_argument("--hang-after", type=int)
    args = parser.parse_args()
    producer = Producer(args.address, hidden=HIDDEN, tap_layers=TAPS, vocab=VOCAB, name=args.name)
    with open(args.ack_log, "a", buffering=1) as log:
        for index, m in enumerate(range(args.first, args.first + args.count)):
            ids, hs, mask = message(args.name, m)
            ack = producer.send(input_ids=ids, hidden_states=hs, loss_mask=mask)
            log.write(f"{m} {ack.batches}\n")
            if args.hang_after is not None and index + 1 == args.hang_after:
                time.sleep(3600)
    ack = producer.done()
    with open(args.ack_log, "a", buffering=1) as log:
        log.write(f"done {ack.batches}\n")


if __name__ == "__main__":
    main()
