# Sourced by the benchmarks/gpu_*.sh device scripts: $OUT, unbuffered Python, carried wheels, and
# the package layout of pyproject's package-dir (hi_sparse -> runtime/, hi_sparse.kernels ->
# kernels/) built from links, since an install would need the network for its build backend.
# Make the wheels here with `make device-wheels` and carry .whl.
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PP=$(mktemp -d)
mkdir -p "$PP/hi_sparse"
for f in runtime/*; do ln -s "$PWD/$f" "$PP/hi_sparse/"; done
ln -s "$PWD/kernels" "$PP/hi_sparse/kernels"
ln -s "$PWD/easymats" "$PP/easymats"
export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
