r"""The scale plan's verdicts from compiled figures: the H200 roofline, what fits, and the tables.

**Roofline** (per device, a lower bound on the step time, so an upper bound on MFU):
  t_compute = executed matmul FLOPs (from the HLO) / peak;
  t_memory  = (arguments + outputs + 2 x temp_gpu) / HBM bandwidth (every buffer written once and read once);
  t_comm    = NVLink wire bytes / NVLink bandwidth + IB wire bytes / IB bandwidth (a group that leaves its node of
              8 GPUs is charged entirely at the IB rate);
  step      = max(t_compute, t_memory, t_comm) (perfect overlap);   MFU bound = model FLOPs / (step x peak).
Model FLOPs per token: 2 x active parameters (the LM head included, the embedding lookup not) plus causal
attention 2 x H x (d_qk + d_v) x L / 2 per layer, per forward; an LM step is 3 forwards' worth (forward +
backward), an RL step 5 (the policy's forward + backward, the unreplayed and the reference forwards).

**H200 figures used** (one GPU of an 8-GPU HGX/DGX H200 node):
- HBM3e 141 GB at 4.8 TB/s; BF16 dense Tensor Core peak 989 TFLOP/s (the datasheet's 1,979 is with 2:4
  sparsity): NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ .
- NVLink 4: 900 GB/s per GPU, both directions together, i.e. 450 GB/s each way: same datasheet.
- InfiniBand between nodes: one ConnectX-7 NDR 400 Gb/s port per GPU = 50 GB/s each way: NVIDIA DGX H200
  datasheet (8x single-port ConnectX-7, 400 Gb/s), https://www.nvidia.com/en-us/data-center/dgx-h200/ .
**Fits** means arguments + temp_gpu + outputs - donated (aliased) bytes <= 141 GB x (1 - HEADROOM), HEADROOM = 10%
for the CUDA context, NCCL buffers and allocator fragmentation.
"""
from __future__ import annotations

import json

H200 = {"hbm_bytes": 141e9, "bf16_flops": 989e12, "hbm_bw": 4.8e12, "nvlink_bw": 450e9, "ib_bw": 50e9,
        "devices_per_node": 8}
HEADROOM = 0.10


def roofline(row: dict) -> dict:
  """Step-time lower bound and MFU upper bound for one row (per device figures)."""
  c = row["collectives"]
  t = {"compute": row["hlo_flops"] / H200["bf16_flops"],
       "memory": (row["argument"] + row["output"] + 2 * row["temp_gpu"]) / H200["hbm_bw"],
       "comm": sum(v["nvlink_bytes"] / H200["nvlink_bw"] + v["ib_bytes"] / H200["ib_bw"] for v in c.values())}
  step = max(t.values())
  return {"t": t, "step_s": step, "limit": max(t, key=t.get),
          "mfu_bound": row["model_flops"] / (step * H200["bf16_flops"]), "tokens_per_s": row["tokens"] / step}


def summarize_case(case: dict) -> dict:
  """One compiled case with its GPU-side temp estimate, fit verdict and roofline."""
  cpu_only = case.get("peak", {}).get("cpu_only_bytes", 0)
  row = dict(case, temp_gpu=case["temp"] - cpu_only)
  row["total"] = row["argument"] + row["temp"] + row["output"] - row["alias"]
  row["total_gpu"] = row["total"] - cpu_only
  budget = H200["hbm_bytes"] * (1 - HEADROOM)
  return {**row, "fits": row["total_gpu"] <= budget, "budget": budget,
          "flops_ratio": row["hlo_flops"] / row["model_flops"], **roofline(row)}


def mesh_str(axes: dict[str, int]) -> str:
  return "x".join(f"{k}={v}" for k, v in axes.items() if v > 1)


def print_table(rows: list[dict]) -> None:
  gb = 1e9
  print(f"Per device, full depth; fits: total_gpu <= {H200['hbm_bytes'] / gb:.0f} GB x (1 - {HEADROOM:.0%}). "
        "Collectives: wire GB per step (NVLink / IB).")
  head = (f"{'stage':13} {'devices':>7} {'mesh':26} {'params+opt':>10} {'temp':>8} {'cpu-only':>8} {'total_gpu':>9} "
          f"{'fits':>5} {'all-gather':>13} {'reduce-scat':>13} {'all-reduce':>13} {'all-to-all':>13} {'permute':>13} "
          f"{'hlo/model':>9} {'t_comp':>7} {'t_mem':>6} {'t_comm':>7} {'limit':>8} {'MFU<=':>6}")
  print(head)
  for r in rows:
    c = r["collectives"]
    cs = " ".join(f"{c[k]['nvlink_bytes'] / gb:6.0f}/{c[k]['ib_bytes'] / gb:<6.0f}" for k in
                  ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"))
    print(f"{r['stage']:13} {r['devices']:>7} {mesh_str(r['axes']):26} {r['params_opt'] / gb:10.1f} "
          f"{r['temp'] / gb:8.1f} {(r['temp'] - r['temp_gpu']) / gb:8.1f} {r['total_gpu'] / gb:9.1f} "
          f"{'yes' if r['fits'] else 'NO':>5} {cs} {r['flops_ratio']:9.2f} "
          f"{r['t']['compute']:7.2f} {r['t']['memory']:6.2f} {r['t']['comm']:7.2f} {r['limit']:>8} "
          f"{r['mfu_bound']:6.1%}")


def markdown_table(rows: list[dict]) -> str:
  """The plan as a markdown table (what composer_jax/parallel/README.md shows, generated from --out files)."""
  gb = 1e9
  lines = ["| stage | devices | mesh | remat | params + opt GB | temp GB (CPU-only) | total GB on GPU | fits | "
           "all-to-all GB | all-gather GB | all-reduce GB | reduce-scatter GB | permute GB | HLO / model FLOPs | "
           "t compute / memory / comm s | limit | MFU bound |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

  def wire(c):
    return f"{(c['nvlink_bytes'] + c['ib_bytes']) / gb:.0f} ({c['ib_bytes'] / gb:.0f} IB)"
  for r in rows:
    c, t = r["collectives"], r["t"]
    lines.append(f"| {r['stage']} | {r['devices']} | {mesh_str(r['axes'])} | {r.get('remat_policy', '')} | "
                 f"{r['params_opt'] / gb:.1f} | "
                 f"{r['temp'] / gb:.1f} ({(r['temp'] - r['temp_gpu']) / gb:.1f}) | {r['total_gpu'] / gb:.1f} | "
                 f"{'yes' if r['fits'] else 'no'} | {wire(c['all-to-all'])} | {wire(c['all-gather'])} | "
                 f"{wire(c['all-reduce'])} | {wire(c['reduce-scatter'])} | {wire(c['collective-permute'])} | "
                 f"{r['flops_ratio']:.2f} | {t['compute']:.2f} / {t['memory']:.2f} / {t['comm']:.2f} | "
                 f"{r['limit']} | {r['mfu_bound']:.1%} |")
  return "\n".join(lines)


def report(rows: list[dict], variant: str, load: tuple, out: str | None = None) -> dict:
  """Prints the table and the last-line JSON (per stage: the smallest mesh that fits and its MFU bound)."""
  print_table(rows)
  best = {}
  for s in dict.fromkeys(r["stage"] for r in rows):
    # The fewest devices; among rows on as many (remat policies, meshes), the highest MFU bound.
    fit = sorted((r for r in rows if r["stage"] == s and r["fits"]), key=lambda r: (r["devices"], -r["mfu_bound"]))
    best[s] = ({"devices": fit[0]["devices"], "mesh": mesh_str(fit[0]["axes"]),
                "remat_policy": fit[0].get("remat_policy"),
                "mfu_bound": round(fit[0]["mfu_bound"], 4), "limit": fit[0]["limit"],
                "total_gpu_gb": round(fit[0]["total_gpu"] / 1e9, 1)} if fit else None)
  summary = {"variant": variant, "smallest_fitting": best,
             "load_avg": [round(x, 2) for x in load],
             "rows": [{"stage": r["stage"], "devices": r["devices"], "mesh": mesh_str(r["axes"]),
                       "remat_policy": r.get("remat_policy"),
                       "total_gpu_gb": round(r["total_gpu"] / 1e9, 1), "fits": r["fits"],
                       "flops_ratio": round(r["flops_ratio"], 3),
                       "mfu_bound": round(r["mfu_bound"], 4), "limit": r["limit"]} for r in rows]}
  if out:
    with open(out, "w") as f:
      json.dump({"variant": variant, "h200": H200, "headroom": HEADROOM, "load_avg": list(load), "rows": rows,
                 "summary": summary}, f, indent=1)
  print(json.dumps(summary))
  return summary
