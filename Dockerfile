# GPU image: CUDA + PyTorch base, ttr installed, `ttr --help` as the smoke check.
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel
WORKDIR /opt/ttr
COPY . /opt/ttr
RUN pip install --no-cache-dir -e ".[eval]" && ttr --help
ENTRYPOINT ["ttr"]
CMD ["--help"]
