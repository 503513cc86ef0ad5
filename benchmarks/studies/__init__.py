"""One-off studies, each run on its own (`python -m benchmarks.studies.NAME --help`): a question
measured once and written up in benchmarks/results/NOTES.md, kept so that it can be asked again.

* `bench_flags`: XLA:CPU's YNNPACK fusion settings per program, levelled sums, the torch frontend;
* `bench_cnn_options`: XLA:CPU's compiler options on the CNN round's per-client convolutions;
* `bench_dlpack`: the per-tensor cost of moving tensors between torch and JAX (CPU or CUDA);
* `bench_xla`: rounds on a torch-xla device (also the "fedsgd"/"fedavg" cases' `/xla` rows);
* `bench_zoo`: first-call and later-step time of the small-model zoo (`tests/helpers/zoo.py`).
"""
