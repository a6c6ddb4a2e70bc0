#!/usr/bin/env bash
# Installs the pinned serverless framework v3 and serverless-offline (from package-lock.json)
# for rollfleet's Lambda compatibility test. Idempotent: does nothing when already installed.
# Needs Node.js >= 18 and npm, and the npm registry.
set -euo pipefail
cd "$(dirname "$0")"
if [ -f node_modules/serverless-offline/package.json ] \
  && [ -f node_modules/serverless/bin/serverless.js ] \
  && [ node_modules/.package-lock.json -nt package-lock.json ]; then
  exit 0
fi
npm ci --no-audit --no-fund --loglevel=error
