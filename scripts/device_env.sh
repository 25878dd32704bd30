# Source on the GPU machine from the repository root:  source scripts/device_env.sh
# Puts the SGLang 0.5.17 bundle (.device, built by ../shared/device/build-sglang-bundle.sh)
# and this checkout on PYTHONPATH, and registers the package's entry points without pip, so
# `python -m sglang.launch_server --speculative-algorithm DDTREE` finds the plugin.
source .device/activate.sh
_dist=/tmp/ddtree-dist/ddtree_sglang-0.1.0.dist-info
mkdir -p "$_dist"
printf 'Metadata-Version: 2.1\nName: ddtree-sglang\nVersion: 0.1.0\n' > "$_dist/METADATA"
printf '[sglang.srt.plugins]\nddtree = ddtree_sglang.sglang_plugin.plugin:register\n' > "$_dist/entry_points.txt"
export PYTHONPATH="$PWD/src:/tmp/ddtree-dist:$PYTHONPATH"
