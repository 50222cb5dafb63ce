"""A process holding one MooncakeTier, driven by JSON lines on stdin.

Run by tests/remote/cluster.py: ``python worker.py '<json options>'``. Prints
``{"ready": state}`` once the tier is built, then one JSON reply per command.
Block bytes are a pure function of (tag, id), so any process can check what
it loads: a loaded block that differs is reported in ``wrong`` (never allowed).

Commands: ``put``, ``get``, ``exists`` (``ids``, ``tag``), ``remove``, ``stats``,
``raw_put`` (a raw Mooncake ``put`` of ``hex`` bytes under a block's object
name: a foreign or hostile writer), ``churn`` (random put/get/exists from
``threads`` threads for ``seconds``), ``exit``.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import random
import sys
import threading
import time

import torch

from tierstore.errors import Status
from tierstore.identity import Namespace, block_hashes
from tierstore.remote import MooncakeTier, ObjectNamer, parse_remote_options

_CHAINS: dict[tuple[str, int], list[bytes]] = {}


def key_of(tag: str, i: int) -> bytes:
    """Block key ``i`` of ``tag``. ``tenant:<name>:<first token>`` gives the keys the
    core derives (tierstore.identity: a Namespace of that tenant, chained block
    hashes of 16-token blocks of tokens first, first+1, ...); any other tag a
    SHA-256 of (tag, i)."""
    if tag.startswith("tenant:"):
        _, tenant, first = tag.split(":")
        chain = _CHAINS.get((tenant, int(first)))
        if chain is None or len(chain) <= i:
            ns = Namespace(model="tiny-llama@rev1", tenant=tenant).digest()
            chain = _CHAINS[(tenant, int(first))] = block_hashes(
                ns, list(range(int(first), int(first) + 16 * (i + 64))), 16
            )
        return chain[i]
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


def block_of(tag: str, i: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key_of(tag, i)[:8], "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class Worker:
    def __init__(self, opts: dict) -> None:
        self.bb = int(opts.pop("block_bytes"))
        ready_wait_s = float(opts.pop("ready_wait_s", 10))
        self.config, tuning = parse_remote_options(opts)
        self.tier = MooncakeTier(self.config, self.bb, tuning=tuning)
        self.tier.wait_ok(ready_wait_s)
        self._blocks: dict[tuple[str, int], torch.Tensor] = {}

    def block(self, tag: str, i: int) -> torch.Tensor:
        b = self._blocks.get((tag, i))
        if b is None:
            b = self._blocks[(tag, i)] = block_of(tag, i, self.bb)
        return b

    def put(self, ids, tag="t", flush=True):
        st = self.tier.put([key_of(tag, i) for i in ids], [self.block(tag, i) for i in ids])
        flushed = self.tier.flush(30) if flush else None
        return {"status": [s.value for s in st], "flushed": flushed}

    def get(self, ids, tag="t"):
        dests = [torch.zeros(self.bb, dtype=torch.uint8) for _ in ids]
        t0 = time.monotonic()
        st = self.tier.get_into([key_of(tag, i) for i in ids], dests)
        dt = time.monotonic() - t0
        wrong = [
            i for i, s, d in zip(ids, st, dests) if s is Status.OK and not torch.equal(d, self.block(tag, i))
        ]
        untouched = all(torch.count_nonzero(d) == 0 for s, d in zip(st, dests) if s is not Status.OK)
        return {"status": [s.value for s in st], "wrong": wrong, "seconds": dt, "untouched": untouched}

    def exists(self, ids, tag="t"):
        t0 = time.monotonic()
        n = self.tier.exists_prefix([key_of(tag, i) for i in ids])
        return {"n": n, "seconds": time.monotonic() - t0}

    def remove(self, ids, tag="t"):
        self.tier.remove([key_of(tag, i) for i in ids])
        return {}

    def stats(self):
        s = self.tier.stats()
        s["errors"] = {str(k): v for k, v in s["errors"].items()}
        return s

    def raw_put(self, i, hex, tag="t"):
        from mooncake.store import MooncakeDistributedStore

        name = ObjectNamer(self.config.cluster, self.config.name_secret_bytes)(key_of(tag, i))
        raw = MooncakeDistributedStore()
        s = self.config
        rc = raw.setup(s.local_hostname, s.metadata, 0, 16 << 20, s.protocol, s.device, s.master)
        assert rc == 0, rc
        rc = raw.put(name, bytes.fromhex(hex))
        raw.close()
        return {"rc": rc, "name": name}

    def object_of(self, i, tag="t"):
        """The valid object bytes this tier would publish for (tag, i), hex."""
        from tierstore.io.format import payload_crc
        from tierstore.remote.format import HEADER_BYTES, encode_header

        k = key_of(tag, i)
        payload = self.block(tag, i).numpy().tobytes()
        buf = bytearray(HEADER_BYTES + len(payload))
        buf[HEADER_BYTES:] = payload
        encode_header(memoryview(buf), k, len(payload), payload_crc(k, payload))
        return {"hex": bytes(buf).hex()}

    def churn(self, seconds, threads=2, keys=48, seed=0, tag="churn"):
        """Random put/get/exists from ``threads`` threads for ``seconds``, half of the
        puts and gets zero-copy (from / into memory registered with the tier)."""
        stop = time.monotonic() + seconds
        counts = {
            "put": 0,
            "get": 0,
            "exists": 0,
            "hits": 0,
            "wrong": 0,
            "max_call_s": 0.0,
            "zero_copy_puts": 0,
            "zero_copy_gets": 0,
            "holds_open": 0,
        }
        lock = threading.Lock()
        # zero-copy sources: every key's block, written once, registered; never changed
        src = torch.cat([self.block(tag, i) for i in range(keys)])
        # zero-copy destinations: one slot per thread
        dst = torch.zeros(threads * self.bb, dtype=torch.uint8)
        held: dict[int, int] = {}

        def hold(off: int, n: int) -> None:
            with lock:
                held[off] = held.get(off, 0) + 1

        def release(off: int, n: int) -> None:
            with lock:
                held[off] -= 1

        self.tier.register_memory(src, hold, release)
        self.tier.register_memory(dst, lambda off, n: None, lambda off, n: None)

        def run(tid: int) -> None:
            rnd = random.Random(seed * 100 + tid)
            plain = torch.zeros(self.bb, dtype=torch.uint8)
            mine = dst[tid * self.bb : (tid + 1) * self.bb]
            while time.monotonic() < stop:
                op = rnd.choice(("put", "get", "get", "exists"))
                zc = rnd.random() < 0.5
                ids = sorted(rnd.sample(range(keys), rnd.randint(1, 4)))
                t0 = time.monotonic()
                hits = wrong = 0
                if op == "put":
                    blocks = [src[i * self.bb : (i + 1) * self.bb] if zc else self.block(tag, i) for i in ids]
                    self.tier.put([key_of(tag, i) for i in ids], blocks)
                elif op == "exists":
                    self.tier.exists_prefix([key_of(tag, i) for i in ids])
                else:
                    dest = mine if zc else plain
                    for i in ids:
                        if self.tier.get_into([key_of(tag, i)], [dest]) == [Status.OK]:
                            hits += 1
                            wrong += not torch.equal(dest, self.block(tag, i))
                dt = time.monotonic() - t0
                with lock:
                    counts[op] += 1
                    counts["hits"] += hits
                    counts["wrong"] += wrong
                    counts["max_call_s"] = max(counts["max_call_s"], dt)

        ths = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        self.tier.flush(30)
        st = self.tier.stats()
        counts["zero_copy_puts"], counts["zero_copy_gets"] = st["zero_copy_puts"], st["zero_copy_gets"]
        with lock:
            counts["holds_open"] = sum(held.values())  # every hold was released
        return counts


def main() -> None:
    faulthandler.enable()  # a native crash prints every thread's Python stack into the worker log
    w = Worker(json.loads(sys.argv[1]))
    print(json.dumps({"ready": w.tier.state}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            w.tier.close()
            print(json.dumps({"closed": True}), flush=True)
            return
        print(json.dumps(getattr(w, op)(**cmd)), flush=True)


if __name__ == "__main__":
    main()
