#!/usr/bin/env bash
# Builds the reward functions as an AWS Lambda custom-runtime package: a zip holding one
# executable named `bootstrap` at its root, for the `provided.al2023` runtime (x86_64).
# Output: $CARGO_TARGET_DIR (or ./target)/lambda/bootstrap.zip. See docs/serverless.md for the
# `aws lambda create-function` / `update-function-code` commands.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
cargo build --release --locked -p rollfleet-lambda-bootstrap --bin bootstrap --manifest-path "$root/Cargo.toml"
bin="$target_dir/release/bootstrap"
out="$target_dir/lambda"
mkdir -p "$out"
# AL2023 ships glibc 2.34: a binary linked against newer symbol versions would not start there.
newest=$(objdump -T "$bin" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1 || true)
echo "bootstrap needs ${newest:-an unknown glibc} (provided.al2023 has GLIBC_2.34)"
cp "$bin" "$out/bootstrap"
# The workspace's release profile keeps debug info; the deployed binary does not need it.
strip "$out/bootstrap" 2>/dev/null || true
python3 - "$out/bootstrap" "$out/bootstrap.zip" <<'PY'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
info = zipfile.ZipInfo("bootstrap")
info.external_attr = (0o100755 << 16)  # regular file, rwxr-xr-x: Lambda executes it
info.compress_type = zipfile.ZIP_DEFLATED
with open(src, "rb") as f, zipfile.ZipFile(dst, "w") as z:
    z.writestr(info, f.read())
print(dst)
PY
