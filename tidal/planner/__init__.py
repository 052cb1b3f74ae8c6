"""Capacity planning (`tidal plan`): the engine's own scheduler and KV/state managers (tidal/core/) run in
simulated time, each step costed from its shape by a roofline model of the device instead of a forward.

    tidal plan --model llama-3-8b --device H100-80GB --request-rate 4 --input-len 1024 --output-len 256

model.py: what a model holds and does per device (from the engine's own layers on the meta device);
devices.py: the device table and calibration files; cost.py: the time of one step; workload.py: the
requests; simulator.py: the loop; report.py: summaries, the SLO search and the plot; calibrate.py:
measures this machine.
"""
