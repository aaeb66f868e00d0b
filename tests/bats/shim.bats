#!/usr/bin/env bats
# The singularity test shim: what xscale relies on from Singularity must hold in the stand-in.

setup() {
  REPO=$(cd "$BATS_TEST_DIRNAME/../.." && pwd -P)
  SHIM=$REPO/tests/shim/singularity
  WORK=$(mktemp -d)
}

teardown() {
  rm -rf "$WORK"
}

@test "exit code of the command passes through" {
  run "$SHIM" exec img bash -c 'exit 7'
  [ "$status" -eq 7 ]
}

@test "runscripts are at /runscripts" {
  run "$SHIM" exec img test -x /runscripts/run.sh
  [ "$status" -eq 0 ]
}

@test "binds: -B src:dst, comma lists, and a new top-level target stays off the host root" {
  echo hello >"$WORK/file"
  mkdir "$WORK/other"
  run "$SHIM" exec -B "$WORK:/xscale-bats-target,$WORK/other" img cat /xscale-bats-target/file
  [ "$status" -eq 0 ]
  [ "$output" = hello ]
  [ ! -e /xscale-bats-target ]
}

@test "a missing nested bind target is refused rather than created on the host" {
  run "$SHIM" exec -B "$WORK:/usr/xscale-bats-missing" img true
  [ "$status" -eq 2 ]
  [[ $output == *"does not exist"* ]]
  [ ! -e /usr/xscale-bats-missing ]
}

@test "environment: host variables pass, SINGULARITYENV_ and --env set variables" {
  HOST_VAR=h SINGULARITYENV_FROM_PREFIX=p APPTAINERENV_FROM_APPTAINER=a run "$SHIM" exec \
    --env FROM_FLAG=f img bash -c 'echo "$HOST_VAR $FROM_PREFIX $FROM_APPTAINER $FROM_FLAG"'
  [ "$status" -eq 0 ]
  [ "$output" = "h p a f" ]
}

@test "working directory is kept" {
  cd "$WORK"
  run "$SHIM" exec img pwd
  [ "$output" = "$WORK" ]
}

@test "USR1 and TERM reach the command, which decides the exit code" {
  cat >"$WORK/payload.sh" <<'PAYLOAD'
trap 'echo got-usr1 >"$1"; exit 42' USR1
echo ready >"$1.ready"
while :; do sleep 0.05; done
PAYLOAD
  "$SHIM" exec img bash "$WORK/payload.sh" "$WORK/mark" &
  local pid=$!
  # Wait for the payload to be up (bounded poll on a marker, not a fixed sleep).
  for _ in $(seq 200); do [ -e "$WORK/mark.ready" ] && break; sleep 0.05; done
  kill -USR1 "$pid"
  local status=0
  wait "$pid" || status=$?
  [ "$status" -eq 42 ]
  [ "$(cat "$WORK/mark")" = got-usr1 ]
}

@test "unsupported subcommands and options are one clear error" {
  run "$SHIM" shell img
  [ "$status" -eq 2 ]
  [[ $output == "singularity: error: "* ]]
  run "$SHIM" exec --cleanenv img true
  [ "$status" -eq 2 ]
}
