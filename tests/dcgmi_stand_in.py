#!/usr/bin/env python3
"""A stand-in for DCGM 4's `dcgmi diag`, for tests on machines without GPUs or DCGM.

It behaves as the real dcgmi does, read from NVIDIA/DCGM's source (github.com/NVIDIA/DCGM); each
behaviour names what it copies:
- [CLP] dcgmi/CommandLineParser.cpp, CommandLineParser::ProcessCommandLine and ProcessDiagCommandLine:
  the subsystem, the diag flags, the checks after parsing;
- [TCLAP] dcgmi/NvcmTCLAP.h (commit 429daa69), DCGMOutput::failure: "PARSE ERROR: ..." and exit 1;
- [MAIN] dcgmi/main_dcgmi.cpp (commit 077135ba): exit status = the dcgmReturn_t; -2 when parsing threw;
- [COMMON] dcgmlib's DcgmDiagCommon.cpp, dcgm_diag_common_populate_run_diag: the -r values;
- [DIAG] dcgmi/Diag.cpp (DCGM 4, dcgmDiagResponse_v12): HelperJsonBuildOutput, HelperJsonAddResult,
  HelperJsonAddTestSummary, HelperJsonAddEntities, HelperJsonAddMetadata, HelperDisplayDiagResult,
  HelperDisplayFailureMessage, RunStartDiag, GetFailureResult, StartDiag::DoExecuteConnectionFailure;
- [JSON] nvvs/include/NvvsJsonStrings.h (commit 0d22068b): the JSON names;
- [CMD] dcgmi/Command.cpp (commit 2fc25add), Command::Connect: the connection error;
- [STRUCTS] dcgm_structs.h dcgmReturn_t, and errorString() (dcgm_errors.cpp) for their text;
- [ERRORS] dcgm_errors.h: error codes, severities (dcgmErrorSeverity_t), categories, messages;
- [PLUGINS] nvvs/include/PluginStrings.h: test names and their categories.

What the diagnostic finds is chosen by the test through DCGMI_STAND_IN_MODE:
  pass           every test passes; exit 0
  fail-memory    the memory test fails on the first GPU with DCGM_FR_FAULTY_MEMORY; exit 205
  warn-pcie      the pcie test warns on the last GPU (DCGM_FR_PCIE_GENERATION, a MONITOR error); exit 226
  no-hostengine  no nv-hostengine, and no embedded one could start
  hang           never finishes (sleeps), as a diagnostic stuck in a GPU would
  garbage        prints what is not JSON and exits 0 (a broken install); DCGMI_STAND_IN_GARBAGE: the text
  truncated      prints the first half of its JSON and exits 0 (a dcgmi killed mid-write)
  huge           a passing run whose info text is DCGMI_STAND_IN_HUGE_BYTES long
DCGMI_STAND_IN_GPUS: how many GPUs the node has (default 2). DCGMI_STAND_IN_ARGS: a file the command line
is appended to, one JSON list a line, for the test to read.
"""

from __future__ import annotations

import json
import os
import sys
import time

DCGM_VERSION = "4.2.3"
DRIVER_VERSION = "570.124.06"
DEVICE_ID = "2330"  # H100 SXM5 80GB's PCI device ID

# [STRUCTS] dcgmReturn_t
ST_OK, ST_BADPARAM, ST_INIT_ERROR, ST_NVVS_ERROR, ST_NVVS_ISOLATE_ERROR = 0, -1, -7, -30, -51
ERROR_STRINGS = {ST_INIT_ERROR: "DCGM initialization error", ST_NVVS_ERROR: "DCGM GPU Diagnostic returned an error",
                 ST_NVVS_ISOLATE_ERROR: "The diagnostic returned an error that indicates the need to drain the GPU"}
# [ERRORS] dcgmError_t codes (their index in dcgmErrorMeta), dcgmErrorSeverity_t, dcgmErrorCategory_t
FR_PCIE_GENERATION, FR_FAULTY_MEMORY = 45, 52
SEVERITY_MONITOR, SEVERITY_ISOLATE = 1, 2
EC_HARDWARE_MEMORY, EC_HARDWARE_PCIE = 10, 13
DCGM_FE_GPU = 1  # dcgm_fields.h; DcgmFieldsGetEntityGroupString(DCGM_FE_GPU) == "GPU"

# [PLUGINS] name -> category; the levels' tests are the DCGM user guide's (r1 deployment; r2 adds PCIe and
# memory; r3 adds the diagnostic, targeted stress and power, memory bandwidth; r4 memtest and pulse)
CATEGORY = {"software": "Deployment", "pcie": "Integration", "memory": "Hardware", "diagnostic": "Hardware",
            "pulse_test": "Hardware", "targeted_stress": "Stress", "targeted_power": "Stress",
            "memory_bandwidth": "Stress", "memtest": "Stress"}
LEVEL_TESTS = {1: ["software"], 2: ["software", "pcie", "memory"],
               3: ["software", "pcie", "memory", "diagnostic", "targeted_stress", "targeted_power",
                   "memory_bandwidth"],
               4: ["software", "pcie", "memory", "diagnostic", "targeted_stress", "targeted_power",
                   "memory_bandwidth", "memtest", "pulse_test"]}
CATEGORY_ORDER = ["Deployment", "Integration", "Hardware", "Stress"]

# [CLP] ProcessDiagCommandLine's arguments: (short flag, long name) -> takes a value
VALUE_ARGS = {("r", "run"), ("g", "group"), ("", "host"), ("p", "parameters"), ("c", "configfile"),
              ("f", "fakeGpuList"), ("", "gpuList"), ("n", "expectedNumEntities"), ("", "debugLogFile"),
              ("", "statspath"), ("d", "debugLevel"), ("", "throttle-mask"), ("", "clocksevent-mask"),
              ("", "check-interval"), ("", "iterations"), ("i", "entity-id"), ("t", "timeout"),
              ("", "watch-frequency"), ("", "ignoreErrorCodes")}
SWITCH_ARGS = {("v", "verbose"), ("", "statsonfail"), ("j", "json"), ("", "train"), ("", "fail-early"),
               ("h", "help")}
UNSIGNED_ARGS = {"group", "check-interval", "iterations", "timeout", "watch-frequency"}
MULTI_ARGS = {"parameters"}  # TCLAP::MultiArg: may be repeated


class ParseError(Exception):
    """A TCLAP::ArgException raised while TCLAP parses: argId is "Argument: <id>"."""

    def __init__(self, arg_id: str, error: str):
        super().__init__(error)
        self.arg_id, self.error = arg_id, error


class CommandLineError(Exception):
    """A TCLAP::CmdLineParseException thrown by ProcessDiagCommandLine after parsing."""

    def __init__(self, error: str, arg: str = ""):
        super().__init__(error)
        self.error, self.arg = error, arg


def parse_diag(argv: list[str]) -> dict[str, object]:
    """TCLAP's parse of `dcgmi diag ...` [CLP]: flags as `-x value`, `--name value`; a switch given twice,
    an unknown flag, a missing or non-numeric value are ArgExceptions."""
    by_flag = {f"-{short}": (short, long) for short, long in VALUE_ARGS | SWITCH_ARGS if short}
    by_flag.update({f"--{long}": (short, long) for short, long in VALUE_ARGS | SWITCH_ARGS})
    values: dict[str, object] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        if token not in by_flag:
            raise ParseError(f"Argument: {token}", "Couldn't find match for argument")
        short, long = by_flag[token]
        ident = f"-{short} (--{long})" if short else f"--{long}"
        if long in values and long not in MULTI_ARGS:
            raise ParseError(f"Argument: {ident}", "Argument already set!")
        if (short, long) in SWITCH_ARGS:
            values[long] = True
            index += 1
            continue
        if index + 1 >= len(argv):
            raise ParseError(f"Argument: {ident}", "Missing a value for this argument!")
        value = argv[index + 1]
        if long in UNSIGNED_ARGS and not value.isdigit():
            raise ParseError(f"Argument: {ident}", f"Couldn't read argument value from string '{value}'")
        if long in MULTI_ARGS:
            values.setdefault(long, []).append(value)  # type: ignore[union-attr]
        else:
            values[long] = int(value) if long in UNSIGNED_ARGS else value
        index += 2
    return values


def check_diag(values: dict[str, object]) -> None:
    """The checks ProcessDiagCommandLine and dcgm_diag_common_populate_run_diag make after parsing [CLP]
    [COMMON]; each raises what they throw."""
    if values.get("train"):
        raise CommandLineError("Specifying training is no longer supported and this code has been removed.")
    if "gpuList" in values and "group" in values:
        raise CommandLineError("Specifying a group id and a gpu list are mutually exclusive")
    if "gpuList" in values and "entity-id" in values:
        raise CommandLineError("Specifying a entity id and a gpu list are mutually exclusive")
    if "entity-id" in values and "group" in values:
        raise CommandLineError("Specifying a group id and a entity id are mutually exclusive")
    if values.get("iterations", 1) == 0:
        raise CommandLineError("The value for iterations cannot be 0.")
    if "check-interval" in values and not values.get("fail-early"):
        raise CommandLineError("The --fail-early option must be enabled", "check-interval")
    run = str(values.get("run", "1"))
    if len(run) <= 1 and run not in ("1", "2", "3", "4"):
        raise CommandLineError(f"Invalid value '{run}' specified for -r.")


def usage_error(arg_id: str, error: str) -> int:
    """[TCLAP] DCGMOutput::failure, then TCLAP exits with ExitException(1)'s status."""
    sys.stderr.write(f"PARSE ERROR: {arg_id}\n             {error}\n\nUsage: \n"
                     f"   dcgmi diag [--host <IP/FQDN>] [-g <groupId>] [-r <diag>] ... [-j] ... [-i <entityId>]\n\n"
                     f"For complete USAGE and HELP type: \n   dcgmi diag --help\n\n")
    return 1


def command_line_error(error: CommandLineError) -> int:
    """[CLP] ProcessCommandLine's catch of TCLAP::ArgException ("Error: <error> for arg <arg>."), then [MAIN]
    main's catch of the runtime_error it rethrows: exit -2."""
    suffix = f" for arg {error.arg}" if error.arg else ""  # argId() is " " for an exception without an arg
    sys.stderr.write(f"Error: {error.error}{suffix}.\n")
    sys.stderr.write("An error occurred trying to parse the command line.\n")
    return -2


def styled(document: dict) -> str:
    """Json::Value::toStyledString: members in key order (jsoncpp keeps objects as sorted maps), three-space
    indentation, " : " between name and value."""
    return json.dumps(document, indent=3, sort_keys=True, separators=(",", " : ")) + "\n"


def gpus_of(values: dict[str, object], gpu_count: int) -> list[int] | str:
    """The GPU IDs -i (or --gpuList) names, "*" and "cpu:*" meaning all GPUs and no GPU; an error text
    otherwise (EntityListWithMigAndUuidParser's refusal)."""
    spec = str(values.get("entity-id", values.get("gpuList", "*,cpu:*")))
    gpus: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        if item in ("*", "gpu:*"):
            gpus += range(gpu_count)
        elif item in ("cpu:*",):
            continue
        elif item.removeprefix("gpu:").isdigit() and int(item.removeprefix("gpu:")) < gpu_count:
            gpus.append(int(item.removeprefix("gpu:")))
        else:
            return f"Failed to parse entity id '{item}'"
    return sorted(set(gpus))


def runtime_error(message: str, as_json: bool) -> None:
    """[DIAG] Diag::HelperDisplayFailureMessage."""
    if as_json:
        sys.stdout.write(styled({"DCGM Diagnostic": {"version": DCGM_VERSION, "runtime_error": message}}) + "\n")
    else:
        sys.stdout.write(message + "\n")


def diag_document(tests: list[str], gpus: list[int], mode: str) -> tuple[dict, int]:
    """[DIAG] HelperJsonBuildOutput's document for this mode's results, and GetFailureResult's return."""
    huge = "x" * int(os.environ.get("DCGMI_STAND_IN_HUGE_BYTES", "0")) if mode == "huge" else ""
    categories: dict[str, list[dict]] = {}
    ret = ST_OK
    for name in tests:
        results = []
        test_status = "Pass"
        for gpu in gpus:
            result = {"entity_group": "GPU", "entity_group_id": DCGM_FE_GPU, "entity_id": gpu, "status": "Pass"}
            if mode == "fail-memory" and name == "memory" and gpu == gpus[0]:
                # [ERRORS] DCGM_FR_FAULTY_MEMORY_MSG, DCGM_ERROR_ISOLATE in dcgmErrorMeta
                result["status"] = "Fail"
                result["warnings"] = [{"warning": f"Found 3 faulty memory elements on GPU {gpu}",
                                       "error_id": FR_FAULTY_MEMORY, "error_category": EC_HARDWARE_MEMORY,
                                       "error_severity": SEVERITY_ISOLATE}]
                ret = ST_NVVS_ISOLATE_ERROR  # GetFailureResult: an ISOLATE error on a GPU wins
            elif mode == "warn-pcie" and name == "pcie" and gpu == gpus[-1]:
                # a DCGM_DIAG_RESULT_WARN is written "Fail" (HelperDisplayDiagResult's default); its error,
                # on a GPU entity and not ISOLATE, makes GetFailureResult return DCGM_ST_NVVS_ERROR
                result["status"] = "Fail"
                result["warnings"] = [{"warning": f"GPU {gpu} is running at PCI link generation 3, which is below "
                                                  f"the minimum allowed link generation of 4 (parameter "
                                                  f"'min_pci_generation')",
                                       "error_id": FR_PCIE_GENERATION, "error_category": EC_HARDWARE_PCIE,
                                       "error_severity": SEVERITY_MONITOR}]
                if ret == ST_OK:
                    ret = ST_NVVS_ERROR
            elif huge:
                result["info"] = [huge]
            if result["status"] != "Pass":
                test_status = "Fail"
            results.append(result)
        # HelperJsonAddTestSummary: the overall result, with the errors of no entity (none here)
        categories.setdefault(CATEGORY[name], []).append(
            {"name": name, "results": results, "test_summary": {"status": test_status}})
    document = {
        "DCGM Diagnostic": {"test_categories": [{"category": category, "tests": categories[category]}
                                                for category in CATEGORY_ORDER if category in categories]},
        "entity_groups": [{"entity_group": "GPU", "entity_group_id": DCGM_FE_GPU,
                           "entities": [{"entity_id": gpu, "device_id": DEVICE_ID,
                                         "serial_num": f"165322301{gpu:04d}"} for gpu in gpus]}],
        "metadata": {"version": DCGM_VERSION, "Driver Version Detected": DRIVER_VERSION},
    }
    return document, ret


def main(argv: list[str]) -> int:
    record = os.environ.get("DCGMI_STAND_IN_ARGS")
    if record:
        with open(record, "a", encoding="utf-8") as file:
            file.write(json.dumps(argv[1:]) + "\n")
    if len(argv) < 2 or argv[1] != "diag":
        # [CLP] ProcessCommandLine: a subsystem it does not know (this stand-in knows only diag)
        sys.stdout.write("ERROR: Invalid subsystem.\n\n")
        return ST_BADPARAM
    try:
        values = parse_diag(argv[2:])
    except ParseError as exc:
        return usage_error(exc.arg_id, exc.error)
    if values.get("help"):
        sys.stdout.write("\ndiag -- Used to run diagnostics on the system.\n\nUsage: dcgmi diag\n")
        return ST_OK
    try:
        check_diag(values)
    except CommandLineError as exc:
        return command_line_error(exc)
    as_json = bool(values.get("json"))
    mode = os.environ.get("DCGMI_STAND_IN_MODE", "pass")
    if mode == "no-hostengine":
        # [CMD] Connect complains only when --host was given ([DIAG] StartDiag: m_silent = !hostAddressWasOverridden);
        # then [DIAG] DoExecuteConnectionFailure tries an embedded host engine, which fails here as it does
        # where DCGM's libraries or permissions are missing. (Which dcgmReturn_t dcgmStartEmbedded_v2 gives
        # depends on why; DCGM_ST_INIT_ERROR is the one this stand-in gives.)
        if "host" in values:
            sys.stdout.write(f"Error: unable to establish a connection to the specified host: {values['host']}\n")
        sys.stdout.write(f"Error: Unable to start an embedded host engine. {ERROR_STRINGS[ST_INIT_ERROR]}.\n")
        return ST_INIT_ERROR
    if mode == "hang":
        # stuck, as a diagnostic waiting on a wedged GPU is; it gives up after an hour only so that a stray
        # left by a broken test does not live forever
        deadline = time.monotonic() + float(os.environ.get("DCGMI_STAND_IN_HANG_S", "3600"))
        while time.monotonic() < deadline:
            time.sleep(1)
        return ST_OK
    if mode == "garbage":
        sys.stdout.write(os.environ.get("DCGMI_STAND_IN_GARBAGE", "Segmentation fault (core dumped)\n\x00\xff{"))
        return ST_OK
    gpus = gpus_of(values, int(os.environ.get("DCGMI_STAND_IN_GPUS", "2")))
    if isinstance(gpus, str):
        runtime_error(f"Error: {gpus}\n", as_json)  # [DIAG] RunDiagOnce: the entity list is refused
        return ST_BADPARAM
    run = str(values.get("run", "1"))
    tests = LEVEL_TESTS[int(run)] if run.isdigit() else [name.strip() for name in run.split(",")]
    unknown = [name for name in tests if name not in CATEGORY]
    if unknown:
        runtime_error(f"Error: Unable to complete diagnostic. Return: (-1) : Bad parameter passed to function\n"
                      f"Unknown test name: {unknown[0]}", as_json)
        return ST_BADPARAM
    iterations = int(values.get("iterations", 1))
    document, ret = diag_document(tests, gpus, mode)
    if not as_json:
        sys.stdout.write("Successfully ran diagnostic for group.\n")
        return ret
    if iterations > 1:
        # [DIAG] RunStartDiag: each iteration's document; the first failing one ends the runs
        ran = [document] if ret != ST_OK else [document] * iterations
        output = {"iterations": ran, "Overall Result": "Pass" if ret == ST_OK else "Fail"}
        if ret != ST_OK:
            output["warning"] = ERROR_STRINGS[ret]
        text = styled(output) + "\n"
    else:
        text = styled(document)
    if mode == "truncated":
        text = text[:len(text) // 2]
    sys.stdout.write(text)
    return ret


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv)
    sys.stdout.flush()
    os._exit(code & 0xFF)  # [MAIN] main returns the dcgmReturn_t; the kernel keeps its low byte
