# GPU image: PyTorch 2.11 (the torch the benchmarks in docs/benchmarks.md ran on) with ttr and its
# test and eval extras installed; `docker run --gpus all IMAGE` prints `ttr --help`.
# The devel variant, because Triton compiles its kernel launcher with the system C compiler.
# BASE picks another CUDA build of the same torch, e.g. pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel.
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE}
WORKDIR /opt/ttr
COPY . /opt/ttr
RUN pip install --no-cache-dir -e ".[test,eval]" && ttr --help > /dev/null
ENTRYPOINT ["ttr"]
CMD ["--help"]
