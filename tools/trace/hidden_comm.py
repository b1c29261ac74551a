#!/usr/bin/env python3
"""How much of each rank's data-parallel communication a step hid behind its compute.

Reads a Chrome trace written by `megatron train|bench --trace FILE` and prints, per rank, the
time its `comm dp` (and `comm edp`) collectives ran, and how much of it fell inside the step's
"forward and backward" phase (the walk), where compute went on beside it.

    python3 tools/trace/hidden_comm.py trace.json
"""
import json
import sys


def main(path):
    events = json.load(open(path))["traceEvents"]
    tracks = {}
    for e in events:
        if e.get("name") == "thread_name":
            tracks[(e["pid"], e["tid"])] = e["args"]["name"]
    walks, comms = {}, {}
    for e in events:
        if e.get("ph") != "X":
            continue
        track = tracks.get((e["pid"], e["tid"]))
        span = (e["ts"], e["ts"] + e["dur"])
        if track == "step" and e["name"] == "forward and backward":
            walks[e["pid"]] = span
        elif track in ("comm dp", "comm edp", "comm dp-cp"):
            comms.setdefault(e["pid"], []).append(span)
    print("rank  dp communication (ms)  inside the walk (ms)  hidden")
    for rank in sorted(comms):
        walk = walks.get(rank, (0, 0))
        total = sum(b - a for a, b in comms[rank])
        inside = sum(max(0, min(b, walk[1]) - max(a, walk[0])) for a, b in comms[rank])
        share = inside / total if total else 0.0
        print(f"{rank:4}  {total / 1000:21.2f}  {inside / 1000:20.2f}  {share:6.1%}")


if __name__ == "__main__":
    main(sys.argv[1])
