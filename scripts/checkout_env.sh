# Source from the repository root, in a shell whose Python imports torch and SGLang 0.5.17:
#   source scripts/checkout_env.sh
# Runs this checkout without installing it: puts src/ (and benchmarks/, the harness) on PYTHONPATH and registers the package's
# SGLang plugin entry point, so `python -m sglang.launch_server --speculative-algorithm DDTREE`
# finds the plugin, and the harness's (its host sampler: idle unless DDTREE_BENCH_HOST_SAMPLES
# is set).  (`pip install -e . && pip install -e benchmarks` does the same for good.)
if ! python -c "import torch, sglang" 2>/dev/null; then
    echo "scripts/checkout_env.sh: this Python cannot import torch and sglang; install" \
         "sglang==0.5.17 (it brings torch 2.11) or activate the environment that has them" >&2
    return 1 2>/dev/null || exit 1
fi
_version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' src/ddtree_sglang/__init__.py)
_dist=/tmp/ddtree-dist/ddtree_sglang-$_version.dist-info
mkdir -p "$_dist"
printf 'Metadata-Version: 2.1\nName: ddtree-sglang\nVersion: %s\n' "$_version" > "$_dist/METADATA"
printf '[sglang.srt.plugins]\nddtree = ddtree_sglang.sglang_plugin.plugin:register\n' > "$_dist/entry_points.txt"
_bench_version=$(sed -n 's/^version = "\(.*\)"/\1/p' benchmarks/pyproject.toml)
_dist=/tmp/ddtree-dist/ddtree_sglang_bench-$_bench_version.dist-info
mkdir -p "$_dist"
printf 'Metadata-Version: 2.1\nName: ddtree-sglang-bench\nVersion: %s\n' "$_bench_version" > "$_dist/METADATA"
printf '[sglang.srt.plugins]\nddtree_bench_host_samples = ddtree_bench.host_sampler:register\n' > "$_dist/entry_points.txt"
export PYTHONPATH="$PWD/src:$PWD/benchmarks:/tmp/ddtree-dist${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
