# g4v69: Gemma 4 E2B -> QNN context binaries for Hexagon v69 (Snapdragon 8 Gen 1) -> Genie bundle.
# `make help` lists the targets. Config values come from the preset (stages/core/presets/$(PRESET).toml);
# a variable left empty here means "the preset's value".

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

# ---- pipeline config overrides (empty: take the preset's value) ----
PRESET        ?= default
MODEL         ?=
MODEL_REVISION ?=
SOC           ?=
PRECISION     ?=
MAX_CONTEXT   ?=
PREFILL_AR    ?=
DECODE_AR     ?=
NUM_SHARDS    ?=
COMPILER      ?=
QAIRT_VERSION ?=
PROMPT        ?= What is the capital of France?
# verify: empty VERIFY_ENGINE = the preset's verify_engine (htp: the whole run on the bundle's binaries
# under the HTP emulation; replay: the run on their compiler inputs, then a bounded set of its calls
# replayed through every binary on the emulation; cpu: the compiler inputs alone); empty thresholds = the defaults: 8 greedy tokens, and top-1 agreement with transformers at the
# preset's quality floor for the precision less 0.05 (stages/runtimes/genie/verify.py). The bundle
# against its own quantized graphs keeps a fixed threshold.
VERIFY_ENGINE ?=
VERIFY_MIN_PREFIX ?=
VERIFY_MIN_TOP1 ?=
# verify's top-1 check on held-out text needs that text (the built-in corpus, or WikiText-2 with
# network); without it verify fails and says so, unless VERIFY_HELDOUT=off, which its report records.
VERIFY_HELDOUT ?= on
# verify runs the bundle under the real Genie (libGenie.so, x86 HTP emulation) first; VERIFY_REAL_GENIE=off
# skips it (at E2B geometry its short query takes tens of minutes), and its report records that; =full
# runs every case (long prompt, token limit, second query, own sampler) where verify's engine would
# run the short query alone (E2B, Gemma 3 270M: minutes to hours; the bench's choice).
VERIFY_REAL_GENIE ?= on
# A snapshot folder you already have: `make download FROM=DIR` imports it instead of downloading, as
# checkpoints/<MODEL's name>, or named after DIR when MODEL is empty.
FROM          ?=

# quantize: extra options (--compare-ple-policies, --calibration-files F, --provider rocm) and its image
QUANT_ARGS    ?=
QUANT_IMAGE   ?= quant
# Extra `docker run` options, e.g. DOCKER_ARGS='--device /dev/kfd --device /dev/dri' for ROCm.
DOCKER_ARGS   ?=

# ---- how and where things run ----
RUNNER        ?= docker
WORKDIR       ?= .
# auto: the official Python image where it can be had, else one built from Debian packages (debootstrap).
BASE_IMAGE    ?= auto
WHEELHOUSE    ?= $(HOME)/.cache/g4v69/wheelhouse
VENV          ?= .venv
PYTHON        ?= python3
PYTEST_ARGS   ?=
# Where pip finds torch's CPU build: the PyTorch CPU index, or a local folder holding the wheel.
TORCH_SOURCE  ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu)

IMAGES        := export quant quant-rocm compile tools
# The debootstrap base: BASE_IMAGE=debootstrap selects it; its tag follows its build script.
DEBOOTSTRAP_BASE := g4v69-base:bookworm-$(shell sha256sum docker/base/build-base.sh | cut -c1-12)
OFFICIAL_BASE    := python:3.11-slim-bookworm
ifeq ($(BASE_IMAGE),debootstrap)
  BASE_REF := $(DEBOOTSTRAP_BASE)
  BASE_DEP := base-image
else ifeq ($(BASE_IMAGE),auto)
  # Resolved at each use (recursive `=`): base-auto may pull the official base or build the
  # debootstrap one before the image recipes that read it run.
  BASE_REF  = $(shell docker/base-ref.sh '$(OFFICIAL_BASE)' '$(DEBOOTSTRAP_BASE)')
  BASE_DEP := base-auto
else
  BASE_REF := $(BASE_IMAGE)
  BASE_DEP :=
endif

ifeq ($(RUNNER),docker)
else ifeq ($(RUNNER),local)
else
  $(error RUNNER=$(RUNNER) is not allowed; allowed values: docker, local)
endif
ifeq ($(filter $(VERIFY_REAL_GENIE),on off full),)
  $(error VERIFY_REAL_GENIE=$(VERIFY_REAL_GENIE) is not allowed; allowed values: on, off, full)
endif

opt = $(if $(strip $(2)),--$(1) '$(strip $(2))')
# MODEL, or (with FROM and no MODEL) the model named after the FROM folder by stages.core.config below.
CONFIG_ARGS = --preset '$(PRESET)' --workdir '$(WORKDIR)' \
  $(call opt,model,$(or $(MODEL),$(if $(FROM),$(call config_name,model)))) $(CONFIG_OPTS)
CONFIG_OPTS = \
  $(call opt,model-revision,$(MODEL_REVISION)) $(call opt,soc,$(SOC)) \
  $(call opt,precision,$(PRECISION)) $(call opt,max-context,$(MAX_CONTEXT)) \
  $(call opt,prefill-ar,$(PREFILL_AR)) $(call opt,decode-ar,$(DECODE_AR)) \
  $(call opt,num-shards,$(NUM_SHARDS)) $(call opt,compiler,$(COMPILER)) \
  $(call opt,qairt-version,$(QAIRT_VERSION)) $(call opt,verify-engine,$(VERIFY_ENGINE))

image_tag = $(shell docker/image-tag.sh $(1) '$(BASE_REF)')
# WORKDIR may hold spaces: recipes quote it, and targets use WD, the same path with `\ ` escapes.
space := $(subst ,, )
WD := $(subst $(space),\$(space),$(WORKDIR))
ABS_WORKDIR := $(shell realpath -m -- '$(WORKDIR)')
# The user's AI Hub client config (COMPILER=aihub without QAI_HUB_API_TOKEN), shown to the container read-only.
QAIHUB_INI := $(abspath $(or $(QAIHUB_CLIENT_INI),$(wildcard $(HOME)/.qai_hub/client.ini)))
# The work tree (and WORKDIR, when it lies outside it) mounted at the same paths as on the host;
# the calling user's UID; no privileges; secrets only as runtime environment, by name (docker
# reads their values from this environment, so they never appear on a command line or in a log).
DOCKER_RUN = docker run --rm -i --user $$(id -u):$$(id -g) --cap-drop ALL $(DOCKER_ARGS) $(2) \
  --security-opt no-new-privileges -v '$(CURDIR):$(CURDIR)' -w '$(CURDIR)' \
  $(if $(filter $(CURDIR)/%,$(subst $(space),?,$(ABS_WORKDIR))/),,-v '$(ABS_WORKDIR):$(ABS_WORKDIR)') \
  $(if $(FROM),-v '$(abspath $(FROM)):$(abspath $(FROM)):ro') \
  $(if $(QAIHUB_INI),-v '$(QAIHUB_INI):$(QAIHUB_INI):ro' -e QAIHUB_CLIENT_INI='$(QAIHUB_INI)') \
  -e PYTHONPATH='$(CURDIR)' -e HF_TOKEN -e QAI_HUB_API_TOKEN -e QNN_SDK_ROOT -e ADB_SERIAL \
  $(foreach v,$(sort $(filter G4V69_%,$(.VARIABLES))),-e $(v))

# $(call g4v69,IMAGE): the command line that runs g4v69 for a stage, in its image or in the venv.
ifeq ($(RUNNER),docker)
  g4v69 = $(DOCKER_RUN) $(call image_tag,$(1)) g4v69 $(CONFIG_ARGS)
  RUNNER_DEP = image-$(1)
else
  g4v69 = '$(VENV)/bin/g4v69' $(CONFIG_ARGS)
  RUNNER_DEP = $(VENV)/.installed
endif

# ---- stage outputs: each stage's report.json is its "done" file ----
STAMP_DIR       = $(WD)/.g4v69
# The model (named after FROM when MODEL is empty), its checkpoint folder's name and each stage's stamp
# name (keyed by the config fields up to that stage), as name=value words, computed on the host
# (stdlib-only module) because rule targets are expanded when make starts. G4V69_<FIELD> variables
# count, as they do for g4v69 (make 4.3 does not give them to $(shell)).
G4V69_FIELD_ENV := $(foreach v,$(filter-out G4V69_PROMPT,$(filter G4V69_%,$(.VARIABLES))),$(v)='$($(v))')
CONFIG_NAMES    := $(shell $(G4V69_FIELD_ENV) $(PYTHON) -m stages.core.config --preset '$(PRESET)' \
  $(call opt,model,$(MODEL)) $(CONFIG_OPTS) $(if $(FROM),--from '$(abspath $(FROM))'))
config_name      = $(patsubst $(1)=%,%,$(filter $(1)=%,$(CONFIG_NAMES)))
CHECKPOINT_NAME := $(call config_name,checkpoint)
# The stage table (stages/core/pipeline.py), one word per stage: name:folder:upstream,...:image:per_checkpoint:stamped.
STAGE_ROWS      := $(shell $(PYTHON) -m stages.core.pipeline rows)
STAGES          := $(foreach r,$(STAGE_ROWS),$(firstword $(subst :, ,$(r))))
stage_row        = $(subst :, ,$(filter $(1):%,$(STAGE_ROWS)))
stage_field      = $(word $(2),$(call stage_row,$(1)))
comma := ,
# $(call stage_report,STAGE): the report.json that says the stage's output is complete.
stage_report     = $(WD)/$(call stage_field,$(1),2)$(if $(filter yes,$(call stage_field,$(1),5)),/$(CHECKPOINT_NAME))/report.json
stage_upstream   = $(filter-out -,$(subst $(comma), ,$(call stage_field,$(1),3)))
# An image variable (QUANT_IMAGE for quantize) overrides the table's image.
stage_image      = $(or $($(1)_IMAGE),$(call stage_field,$(1),4))
# A stamped stage reruns when its stamp for this config is missing; a check without one, whenever asked.
# (A config the module refuses names nothing; the stage then says why and writes nothing.)
stage_stamp      = $(if $(filter yes,$(call stage_field,$(1),6)),$(STAMP_DIR)/$(or $(call config_name,$(1)),no-config-$(1)),FORCE)
# What each stage's command line adds to the config (empty for the others).
download_ARGS    = $(call opt,from,$(if $(FROM),$(abspath $(FROM))))
quantize_ARGS    = $(QUANT_ARGS)
quantize_IMAGE   = $(QUANT_IMAGE)
verify_ARGS      = $(call opt,min-prefix,$(VERIFY_MIN_PREFIX)) \
  $(call opt,min-top1,$(VERIFY_MIN_TOP1)) $(if $(filter off,$(VERIFY_HELDOUT)),--no-heldout,--heldout) \
  $(if $(filter off,$(VERIFY_REAL_GENIE)),--no-real-genie,--real-genie) \
  $(if $(filter full,$(VERIFY_REAL_GENIE)),--all-real-genie-cases)
verify_QUIET     = @
verify_AFTER     = @echo "bundle: $(ABS_WORKDIR)/genie_bundle"
# The prompt reaches g4v69 through the environment, unexpanded: `$`, quotes and newlines stay as typed.
# PROMPT itself is not exported: make would expand it (and run a `$(shell ...)` in it) to do so.
unexport PROMPT
export G4V69_PROMPT = $(value PROMPT)
# Progress bars: a container has no terminal (docker run -i), so every stage is told whether the
# host's stderr is one: bars on a terminal, a plain line per 30 s in a log (stages/core/progress.py).
ifeq ($(origin G4V69_PROGRESS),undefined)
  G4V69_PROGRESS := $(if $(shell [ -t 2 ] && echo tty),bars,lines)
endif
export G4V69_PROGRESS

.PHONY: help setup expected-time images wheelhouse base-image base-auto lock $(STAGES) \
  push run generate demo bench bench-270m bench-quality bench-calibration plan doctor image-tag test test-unit test-container lint docs clean venv g4v69 FORCE \
  $(addprefix image-,$(IMAGES))

help: ## list the targets and variables
	@echo "Stages (in order; each runs the ones before it that are not done):"
	@$(PYTHON) -m stages.core.pipeline help
	@echo "Targets:"
	@grep -E '^[a-z][a-z0-9-]*:.*## ' $(MAKEFILE_LIST) | \
	  awk -F':.*## ' '{ printf "  %-12s %s\n", $$1, $$2 }'
	@echo
	@echo "Variables (empty = the preset's value; see stages/core/presets/$(PRESET).toml):"
	@echo "  PRESET=$(PRESET) MODEL MODEL_REVISION SOC PRECISION MAX_CONTEXT PREFILL_AR DECODE_AR"
	@echo "  NUM_SHARDS COMPILER=local|aihub (aihub: QAI_HUB_API_TOKEN) QAIRT_VERSION PROMPT FROM=DIR (import a snapshot) RUNNER=docker|local WORKDIR=$(WORKDIR)"
	@echo "  QUANT_ARGS (e.g. --compare-ple-policies) QUANT_IMAGE=quant|quant-rocm DOCKER_ARGS"
	@echo "  VERIFY_ENGINE=htp|replay|cpu VERIFY_MIN_PREFIX VERIFY_MIN_TOP1 (verify's pass thresholds against transformers) VERIFY_HELDOUT=on|off VERIFY_REAL_GENIE=on|off|full"
	@echo "  GRAPHS=exported|quantized (make generate: the float graphs, or the bundle's quantized ones as Genie feeds them)"
	@echo "  BASE_IMAGE=$(BASE_IMAGE) (auto, debootstrap or an image) WHEELHOUSE=$(WHEELHOUSE)"

# ---- pipeline ----
# Each stage's rule comes from its row of the stage table: its report depends on its upstream stages'
# reports and its stamp, and its recipe runs `g4v69 <stage>` in its image. A stage reruns when an input
# report changed or its stamp for this config is missing. A stage writes its stamp
# (WORKDIR/.g4v69/<stage>-<config hash>.json, dated like its report) only when it succeeds, and removes
# its stamps of other configs, whose output it has just replaced; so a command with another PRESET
# neither invalidates this config's results nor reuses the other's. A stage that finds an input changed
# since it was written removes that input's stamps, so the stage that makes it runs again. verify is a
# check: it runs whenever asked (with the PROMPT given), on top of a finished bundle.
define stage_rule
$(call stage_report,$(1)): $(foreach u,$(call stage_upstream,$(1)),$(call stage_report,$(u))) $(call stage_stamp,$(1)) | $$(call RUNNER_DEP,$(call stage_image,$(1)))
	$$($(1)_QUIET)$$(call g4v69,$(call stage_image,$(1))) $(1) $$($(1)_ARGS)
	$$($(1)_AFTER)
$(1): $(call stage_report,$(1))
$(if $(filter yes,$(call stage_field,$(1),6)),$(call stage_stamp,$(1)): ;)
endef
# `make bundle` first says how long the job should take here and its peak memory (from the committed
# bench runs, scaled to this machine's cores), unless the bundle is already built. Read before the stage
# rules, so it runs before them.
bundle: expected-time
expected-time: | $(call RUNNER_DEP,tools)
	@$(call g4v69,tools) expected-time --unless-bundled
$(foreach s,$(STAGES),$(eval $(call stage_rule,$(s))))

# push/run in the tools image talk to the phone through the host's adb server (`adb start-server` on the
# host; the container shares the host network) or through USB passed in with
# DOCKER_ARGS='--device /dev/bus/usb'. QNN_SDK_ROOT (your QAIRT SDK) is shown to it read-only.
DEVICE_RUN_ARGS = $(if $(filter docker,$(RUNNER)),--network host $(if $(QNN_SDK_ROOT),-v '$(QNN_SDK_ROOT):$(QNN_SDK_ROOT):ro'))
push: $(call stage_report,bundle) | $(call RUNNER_DEP,tools) ## adb-push the bundle and QAIRT runtime (QNN_SDK_ROOT) to the phone
	$(call g4v69,tools,$(DEVICE_RUN_ARGS)) push
run: | $(call RUNNER_DEP,tools) ## run PROMPT on the phone with genie-t2t-run (after make push)
	$(call g4v69,tools,$(DEVICE_RUN_ARGS)) run
generate: $(call stage_report,export) | $(call RUNNER_DEP,export) ## run PROMPT through the exported graphs on the host (GRAPHS=quantized: the bundle's quantized graphs, greedy)
	@$(call g4v69,export) generate $(call opt,graphs,$(GRAPHS))
# The tiny model knows Python docstrings only; a prompt from its domain (out of it, its first tokens are
# near-ties that any 8-bit model may flip: see docs/verification.md).
DEMO_PROMPT ?= Return the first element of a list.
demo: ## the built-in tiny model through every stage to a verified bundle
	$(MAKE) --no-print-directory verify PRESET=tiny PROMPT='$(DEMO_PROMPT)'

# The scale benchmark: the full E2B geometry with random weights through export, quantize, the local
# compile, bundle and verify, resumable (finished stages are kept), then a results table from the stages' own reports.
BENCH_MODEL       ?= e2b-random
BENCH_WORKDIR     ?= $(WORKDIR)/bench-work
BENCH_RESULTS     ?= ci/bench-results
# The preset's own calibration recipe and dataset, as `make bundle` runs it: WikiText-2 is read from its
# local copy in BENCH_WORKDIR/datasets/ (where the Hub cannot be reached, `g4v69 wikitext-stand-in`
# writes the built-in corpus there in WikiText-2's layout first). A cut-down run:
# BENCH_CALIBRATION="G4V69_CALIBRATION_DATASET=files G4V69_CALIBRATION_SAMPLES=1 G4V69_CALIBRATION_TOKENS=256".
BENCH_CALIBRATION ?=
BENCH_DATASET_COPY = $(BENCH_WORKDIR)/datasets/Salesforce/wikitext/README.md
# Random weights: the preset's quality floors judge a trained model's quantization, not this one's, so
# the bench lifts them (quantize still measures and reports its quality figures).
BENCH_FLOORS ?= G4V69_MIN_TOP1_AGREEMENT_W8=0 G4V69_MAX_KL_DIVERGENCE_W8=1000 \
  G4V69_MIN_TOP1_AGREEMENT_W4=0 G4V69_MAX_KL_DIVERGENCE_W4=1000
# Random weights agree with transformers on no particular number of greedy tokens: the bench asks none
# (verify's runtime checks, the replay on the binaries included, stand as they are).
BENCH_VERIFY ?= VERIFY_MIN_PREFIX=0
# A word for the results' file name beside the date, for a run that is not the preset's (a cut calibration).
BENCH_NAME ?=
bench: | $(call RUNNER_DEP,quant) ## E2B-size bench: every stage to verify, then ci/bench-results/<date>-<machine>.{json,md}
	@[ -f '$(BENCH_DATASET_COPY)' ] || $(call g4v69,quant) --workdir '$(BENCH_WORKDIR)' wikitext-stand-in
	$(BENCH_CALIBRATION) $(BENCH_FLOORS) $(MAKE) --no-print-directory verify MODEL=$(BENCH_MODEL) \
	  WORKDIR='$(BENCH_WORKDIR)' $(BENCH_VERIFY)
	@$(call g4v69,tools) --model $(BENCH_MODEL) --workdir '$(BENCH_WORKDIR)' bench-report $(call opt,name,$(BENCH_NAME)) \
	  --output '$(BENCH_RESULTS)' --command '$(strip make bench BENCH_MODEL=$(BENCH_MODEL) $(if $(PRECISION),PRECISION=$(PRECISION)) $(BENCH_CALIBRATION))'

# Real weights under the real Genie: Gemma 3 270M's preset built and verified with every real-Genie
# case (VERIFY_REAL_GENIE=full: the chat prompt, past and across the 512-token window, the token limit,
# a second query, its own sampler), each answer at verify's slow-size token count, the own sampler
# from a prompt 4-8 tokens short of a full context, which it must meet (about 25 s a call on the x86
# emulation here: the 2,000-token prompt is about half of the run).
BENCH_270M_WORKDIR ?= $(BENCH_WORKDIR)/gemma3-270m
bench-270m: | $(call RUNNER_DEP,quant) ## Gemma 3 270M: bundle, verify with every real-Genie case, then ci/bench-results/<date>-gemma3-270m-<machine>.{json,md}
	$(MAKE) --no-print-directory verify PRESET=gemma3-270m WORKDIR='$(BENCH_270M_WORKDIR)' VERIFY_REAL_GENIE=full
	@$(call g4v69,tools) --preset gemma3-270m --workdir '$(BENCH_270M_WORKDIR)' bench-report \
	  --name gemma3-270m --output '$(BENCH_RESULTS)' --command 'make bench-270m'

# In the export image: the bench downloads and exports the tiny models (torch, transformers) as well as
# quantizing them; then the table on Gemma 3 270M's real weights (about an hour on 2 CPUs: rows past the
# budget are dropped, least informative first, and the table names them).
BENCH_QUALITY_REAL_MIN ?= 70
bench-quality: | $(call RUNNER_DEP,export) ## weight schemes, LUT bits and QAT checkpoints side by side: tiny-model and Gemma 3 270M quality, E2B rounding cost
	@$(call g4v69,export) --workdir '$(BENCH_WORKDIR)' bench-quality --output '$(BENCH_RESULTS)'
	@$(call g4v69,export) --workdir '$(BENCH_WORKDIR)' bench-quality-real --output '$(BENCH_RESULTS)' \
	  --budget-min $(BENCH_QUALITY_REAL_MIN)

# In the export image too: it downloads and exports the tiny model, then quantizes it once per recipe.
bench-calibration: | $(call RUNNER_DEP,export) ## the calibration recipe: tiny-model quality against what each pass reads, E2B cost per size
	@$(call g4v69,export) --workdir '$(BENCH_WORKDIR)' bench-calibration --output '$(BENCH_RESULTS)'

plan: | $(call RUNNER_DEP,tools) ## print the memory/size/throughput plan of the config
	@$(call g4v69,tools) plan
doctor: | $(call RUNNER_DEP,tools) ## check the environment (packages, docker, disk, tokens, SDK)
	@$(call g4v69,tools) doctor
IMAGE ?= tools
ARGS  ?= --help
g4v69: | $(call RUNNER_DEP,$(IMAGE)) ## run any g4v69 command: make g4v69 IMAGE=export ARGS='plan --json'
	@$(call g4v69,$(IMAGE)) $(ARGS)

print-%: ## print a make variable (for scripts): make -s print-BASE_REF
	@echo '$($*)'

image-tag: ## print the tag of IMAGE's image (for scripts): make -s image-tag IMAGE=export
	@docker/image-tag.sh '$(IMAGE)' '$(BASE_REF)'

# ---- images, wheelhouse, venv ----
setup: ## a fresh host: install Docker and debootstrap where missing (root or sudo), start dockerd, build images and .venv
	@docker/host-setup.sh tools
	@docker/host-setup.sh engine
	@$(MAKE) --no-print-directory images venv
base-image: ## build the Debian base image with debootstrap (for hosts without a registry)
	@docker/base/build-base.sh '$(DEBOOTSTRAP_BASE)' >&2
base-auto:
	@docker info >/dev/null 2>&1 || { echo "error: no Docker engine answers; run \`make setup\` (installs Docker and debootstrap where missing, starts dockerd), or use RUNNER=local (make venv)" >&2; exit 1; }
	@docker/ensure-base.sh '$(OFFICIAL_BASE)' '$(DEBOOTSTRAP_BASE)'

lock: ## regenerate docker/*/requirements.lock with uv (needs network)
	$(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl),TORCH_FIND_LINKS=/opt/wheels) docker/lock.sh

wheelhouse: $(BASE_DEP) ## download every locked wheel (and the tools image's .debs) into WHEELHOUSE
	$(PYTHON) docker/wheelhouse.py fill '$(WHEELHOUSE)' $(foreach i,local $(IMAGES),docker/$(i)/requirements.lock) -- $(TORCH_SOURCE)
	for i in $(IMAGES); do docker/fill-debs.sh $$i '$(BASE_REF)' '$(WHEELHOUSE)'; done

images: $(addprefix image-,$(IMAGES)) ## build every stage image offline from the wheelhouse

$(addprefix image-,$(IMAGES)): image-%: $(BASE_DEP)
	@docker info >/dev/null 2>&1 || { echo "error: no Docker engine answers; run \`make setup\` (installs Docker and debootstrap where missing, starts dockerd), or use RUNNER=local (make venv)" >&2; exit 1; }
	@if ! docker image inspect "$$(docker/image-tag.sh $* '$(BASE_REF)')" >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory wheelhouse >&2; fi
	@docker/build-image.sh $* '$(BASE_REF)' '$(WHEELHOUSE)' >&2

venv: $(VENV)/.installed ## make .venv for RUNNER=local, offline from the wheelhouse
$(VENV)/.installed: docker/local/requirements.lock pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else \
	  "error: the locks are for CPython 3.11; set PYTHON=python3.11 (found %s)" % sys.version.split()[0])'
	$(PYTHON) docker/wheelhouse.py fill '$(WHEELHOUSE)' docker/local/requirements.lock -- $(TORCH_SOURCE)
	rm -rf '$(VENV)'
	$(PYTHON) -m venv '$(VENV)'
	PIP_NO_INDEX=1 PIP_FIND_LINKS='$(WHEELHOUSE)/pool' PIP_CONSTRAINT= '$(VENV)/bin/pip' install -q \
	  --disable-pip-version-check --no-deps --require-hashes -r docker/local/requirements.lock
	PIP_NO_INDEX=1 PIP_CONSTRAINT= '$(VENV)/bin/pip' install -q --disable-pip-version-check --no-deps \
	  --no-build-isolation -e .
	touch '$@'

# ---- tests ----
test: $(VENV)/.installed ## run the unit tests and the container tier (needs Docker; see docs/testing.md)
	'$(VENV)/bin/python' -m pytest $(PYTEST_ARGS)
test-unit: $(VENV)/.installed ## run only the fast unit tests
	'$(VENV)/bin/python' -m pytest -m 'not container' $(PYTEST_ARGS)
lint: $(VENV)/.installed ## ruff over the package and tests
	'$(VENV)/bin/ruff' check stages tests docker
docs: ## rewrite the generated pages docs/make.md and docs/benchmarks.md, then check every docs link
	$(PYTHON) -m stages.tools.docs

# Stage folders per checkpoint (checkpoints/) keep their contents; a folder the repository tracks (its
# README.md) stays, emptied.
per_checkpoint = $(filter yes,$(call stage_field,$(1),5))
clean: ## remove stage outputs under WORKDIR (not checkpoints and their stamps, images or the wheelhouse)
	for f in $(foreach s,$(STAGES),$(if $(call per_checkpoint,$(s)),,'$(WORKDIR)/$(call stage_field,$(s),2)')); do \
	  [ -d "$$f" ] || continue; find "$$f" -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +; rmdir "$$f" 2>/dev/null || true; done
	rm -f '$(WORKDIR)/.g4v69/aihub_jobs.json' $(foreach s,$(STAGES),$(if $(call per_checkpoint,$(s)),,'$(WORKDIR)/.g4v69/'$(s)-*.json))
	rm -rf '$(WORKDIR)/.g4v69/genie-logs'  # verify's real-Genie logs (stages/runtimes/genie/verify.py GENIE_LOGS)
	$(foreach s,$(STAGES),$(if $(call per_checkpoint,$(s)),$(PYTHON) -m stages.core.report clean '$(WORKDIR)' '$(WORKDIR)/$(call stage_field,$(s),2)';))

FORCE:
