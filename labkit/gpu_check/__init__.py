"""Check a GPU against the lab in one command: kernels correct, kernels fast, both phases measured.

    python -m labkit.gpu_check --out DIR [--dry-run] [--budget-s 420] [--only SECTION,...]
    make gpu-check OUT=DIR [DRY=1]

Sections, in order; each writes its recording into DIR the moment it finishes, named
`<section>-<device>-<YYYYmmdd-HHMM>.json` (labkit.recordings: never overwritten). Until then its
finished steps are appended to `<same name>.partial.jsonl`, so a run killed mid-section keeps
them; a section that raises is recorded with its error and the next one runs:

  calibration    provenance (device, driver, torch/triton versions, date, command) and this
                 machine's measured roofline (labkit.calibrate; measured afresh on a GPU)
  correctness    each kernel against its torch reference on fresh seeded random inputs, at the
                 8B's sizes: matmul M=2048 (K, N = 4096/14336); causal flash attention H=32,
                 Hkv=8, D=128 at P = 1k, 4k and 1k queries after 3k cached; decode attention over
                 bf16, fp8 and int8 caches quantised on the GPU, B=16 at S=8k and B=1 at S=64k;
                 int8/fp8 quantisation itself (the fp8 cast the CPU interpreter gets wrong);
                 tolerances from kernels/tolerances.py, the table the kernel tests read
  kernels        each kernel against its torch baseline, the roofline bound printed first
  prefill_sweep  the Llama-3.1-8B-shaped model's prefill, P = 512 ... 32k, batch 1
  decode_sweep   its decode step at S = 8k, batch 1 ... the largest that fits (>= 64), and at
                 batch 1 for S = 1k ... 128k; bf16, fp8 and int8 caches; the step replayed as
                 a CUDA graph (labkit.graphed_decode: each point's "kernels" says "triton+graph",
                 or the model's decode_reason says why not)

Targets (reported in the final JSON line; only a failed correctness check changes the exit code):
  matmul >= 0.85 x torch.matmul;  flash attention >= 400 TFLOP/s (causal bf16) at P >= 4k;
  fp8/int8 decode attention >= 1.5 x faster than bf16 at S >= 32k.

--budget-s is shared among the sections (SHARES; time a section leaves passes to the next). A
step starts only while its section has at least as long left as its previous step took; what
does not start is recorded as `skipped: budget`, as is what does not fit in memory (checked
before allocating). --dry-run takes the same steps at toy sizes with the lab-tiny model, in under
a minute: on the GPU if there is one, else on the CPU in Triton's interpreter with fp16 kernels
(its bf16 is broken). Exit codes: 0 done (the last line names any correctness check that did not
run, and why); 1 a correctness check failed; 2 bad arguments, no GPU, or DIR unwritable.
Not measured here: L2 residency. Caches under the L2's 50-60 MB (fp8/int8 at S=16k, B=1) stay
partly in an H100/H200's L2 between timed calls, so their bandwidth fraction can read high.

On a GPU machine with no make (and no .git beside the tree), as one command:
    LABKIT_GIT_COMMIT=<commit> PYTHONUNBUFFERED=1 timeout 480 python3 -m labkit.gpu_check --out DIR

The package, one job per module (each imports only torch, triton and numpy beyond the standard
library and labkit's Jupyter-free core, so it runs on a GPU image with nothing else installed):

  command         the command: arguments, device and interpreter, the sections in turn, the last line
  run             what the sections share: sizes, the budget, steps logged as they finish,
                  recordings, the roofs each timing is compared with
  calibration, correctness, kernel_timing, model_sweeps   one section each
"""
from .command import main

__all__ = ["main"]
