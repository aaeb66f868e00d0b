# shellcheck shell=bash
# A user's Python environment on top of the image (packages the image lacks), in one of the two
# forms that keep thousands of ranks from importing thousands of small files from Lustre each
# (docs/STAGING.md says when each wins). In a job script, after container-paths.sh:
#
#   source "$XSCALE_ROOT/jobs/lib/user-env.sh"
#   xs_user_env "$STAGE_DIR"     # reads ENV_SQSH or ENV_DIR; may add to BINDS
#
# ENV_SQSH=/project/.../env.sqsh: the venv made into one squashfs file (mksquashfs), mounted
#   read-only at /user-software with `-B env.sqsh:/user-software:image-src=/`, its bin/ first on
#   PATH inside the container (SINGULARITYENV_PREPEND_PATH), as the LUMI AI Guide does ("02.
#   Setting up your own environment", "Adjustments for filesystem performance"). Each node opens
#   one Lustre file and reads the pages it needs.
# ENV_DIR=/project/.../venv: a venv (or a `pip install --target` directory) staged once per node
#   into node-local storage by jobs/lib/stage; its site-packages goes first on PYTHONPATH inside
#   the container (SINGULARITYENV_PYTHONPATH). PYTHONPATH rather than the venv's own python: a
#   copied venv's bin/ scripts keep shebangs with the shared path, and its pyvenv.cfg names an
#   interpreter that may not be the image's.

# Sets BINDS and the SINGULARITYENV_ variables for ENV_SQSH or ENV_DIR; nothing when neither.
xs_user_env() {
  local stage_dir=$1 staged
  if [[ -n ${ENV_SQSH:-} && -n ${ENV_DIR:-} ]]; then
    xs_job_die "ENV_SQSH and ENV_DIR are both set: give the environment in one form"
  fi
  if [[ -n ${ENV_SQSH:-} ]]; then
    xs_require_host_file ENV_SQSH
    BINDS=$BINDS,$ENV_SQSH:/user-software:image-src=/
    export SINGULARITYENV_PREPEND_PATH=/user-software/bin
  elif [[ -n ${ENV_DIR:-} ]]; then
    [[ -d $ENV_DIR ]] || xs_job_die "ENV_DIR='$ENV_DIR' is not a directory"
    staged=$("$XSCALE_ROOT/jobs/lib/stage" --dest "$stage_dir" --name user-env "$ENV_DIR") || {
      "$XSCALE_ROOT/jobs/lib/stage" --clean --dest "$stage_dir" || true
      exit 1
    }
    SINGULARITYENV_PYTHONPATH=$(xs_site_packages "$staged")${PYTHONPATH:+:$PYTHONPATH}
    export SINGULARITYENV_PYTHONPATH
  fi
}

# The site-packages of a venv or conda environment at ROOT (lib/python3.*/site-packages), or ROOT
# itself for a `pip install --target` directory. Read on the batch host, which is one of the
# job's nodes and holds the same staged copy as the others.
xs_site_packages() {
  local root=$1
  local -a found=("$root"/lib/python3*/site-packages)
  if [[ -d ${found[0]} ]]; then
    printf '%s' "${found[0]}"
  else
    printf '%s' "$root"
  fi
}
