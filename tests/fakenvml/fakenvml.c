/*
 * A fake libnvidia-ml.so.1 for end-to-end tests and benchmarks.
 *
 * Compiled against the real nvml.h (PyPI package nvidia-nvml-dev) with
 * -DNVML_NO_UNVERSIONED_FUNC_DEFS, so every exported symbol has exactly the name and
 * prototype the driver's library has (nvmlDeviceGetCount_v2, ..._v3), and every struct is
 * the header's own. Only the functions defined here with EXPORT are in the dynamic symbol
 * table; anything else is absent, and pynvml answers NVML_ERROR_FUNCTION_NOT_FOUND for it,
 * as with an older driver.
 *
 * The GPUs come from a text file named by $FAKENVML_CONFIG, re-read whenever its mtime,
 * size or inode changes (write a new file and rename it over the old one). One directive a
 * line, '#' starts a comment:
 *
 *   gpus 8                               number of GPUs (at most 256)
 *   driver_version 550.54.15             nvmlSystemGetDriverVersion
 *   cuda_driver_version 12040            nvmlSystemGetCudaDriverVersion (12.4)
 *   error FUNCTION ERROR                 a library-level function fails (nvmlInitWithFlags,
 *                                        nvmlDeviceGetCount_v2, ...); ERROR as GPU_IS_LOST
 *   hang FUNCTION SECONDS                a library-level function sleeps first
 *   GPU KEY VALUE...                     GPU is an index or '*' (every GPU); keys below
 *
 * Per-GPU keys (defaults: an idle 80 GiB A100):
 *   name, uuid, pci_bus_id                      text (the rest of the line)
 *   memory_total, memory_used, memory_reserved  bytes; free = total - used - reserved
 *   utilization_gpu, utilization_memory         percent
 *   utilization_encoder, utilization_decoder    percent
 *   pcie_tx_kbps, pcie_rx_kbps                  KB/s
 *   power_usage_mw, power_limit_mw, energy_mj, temperature_c, fan_percent
 *   clock_graphics_mhz, clock_sm_mhz, clock_memory_mhz, clock_video_mhz
 *   processes PID:BYTES PID:BYTES ...           compute processes (replaces the list)
 *   synthetic_processes N BYTES                 N processes with made-up PIDs 4000000+
 *   error FUNCTION|* ERROR                      that call on this GPU fails with ERROR
 *   hang FUNCTION|* SECONDS                     that call on this GPU sleeps first
 *
 * ... and what an A100-SXM4-80GB reports besides (defaults: a healthy one; see default_gpu):
 *   clock_max_graphics_mhz, clock_max_sm_mhz, clock_max_memory_mhz, clock_max_video_mhz
 *   temperature_shutdown_c, temperature_slowdown_c, temperature_memory_max_c, temperature_gpu_max_c
 *   power_default_limit_mw, power_min_limit_mw, power_max_limit_mw
 *   clocks_event_reasons MASK                   nvmlClocksEventReason* bits (0x1 idle, 0x4 cap)
 *   pstate, persistence_mode, compute_mode, ecc_mode
 *   ecc_corrected_volatile, ecc_corrected_aggregate, ecc_uncorrected_volatile,
 *   ecc_uncorrected_aggregate                   nvmlDeviceGetTotalEccErrors
 *   remapped_correctable, remapped_uncorrectable, remapped_pending, remapped_failed
 *   retired_pages SBE DBE PENDING               makes nvmlDeviceGetRetiredPages* answer (a
 *                                               pre-Ampere card); NOT_SUPPORTED without it
 *   pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, pcie_replays
 *   mig_mode, max_mig_devices, supported_events MASK
 *   xid CODE                                    one more Xid event for nvmlEventSetWait_v2: a
 *                                               waiting set gets each configured event once
 *
 * ... and what nvmlDeviceGetFieldValues answers besides the getters' values (issue 31):
 *   memory_temperature_c                        NVML_FI_DEV_MEMORY_TEMP (default 35)
 *   nvlink_links N                              NVLinks (default 0: NOT_SUPPORTED, a PCIe card)
 *   nvlink LINK STATE TX_KIB RX_KIB CRC_FLIT CRC_DATA REPLAY RECOVERY
 *                                               one link's state and counters (default:
 *                                               active, all 0)
 *   error field:ID ERROR                        that entry alone answers ERROR (the call
 *                                               succeeds); "error nvmlDeviceGetFieldValues
 *                                               ERROR" fails the whole call
 * A field that is a getter's value in another shape answers as that getter would: its
 * error rule fails the entry, its hang rule holds the whole call.
 *
 * GPM and per-process utilization (Hopper; defaults: no GPM, as an A100):
 *   gpm_supported 0|1                           nvmlGpmQueryDeviceSupport's isSupportedDevice
 *   gpm METRIC_ID VALUE                         what nvmlGpmMetricsGet answers for that
 *                                               NVML_GPM_METRIC_* id (percent, MiB/s); ids
 *                                               not given answer NOT_SUPPORTED in their entry
 *   gpm_instances GI:SM GI:SM ...               MIG GPU instances nvmlGpmMigSampleGet samples,
 *                                               with their SM_UTIL (their other metrics:
 *                                               NOT_SUPPORTED)
 *   process_utilization PID:SM:MEM ...          nvmlDeviceGetProcessUtilization's samples;
 *                                               none: NOT_FOUND, as the driver with no process
 *                                               that did anything
 *
 * Clock event reason durations and fabric info (the block at the end of this file):
 *   clocks_event_rate REASON NS_PER_S           how fast that reason's duration grows (REASON:
 *                                               sw_power_cap, sync_boost, sw_therm_slowdown,
 *                                               hw_therm_slowdown, hw_power_brake_slowdown);
 *                                               default: 1e9 while its bit is in
 *                                               clocks_event_reasons, 5e6 for sw_power_cap
 *                                               while utilization_gpu > 0, else 0
 *   clocks_event_ns REASON NS                   its duration when the library loaded (0)
 *   clocks_event_durations 0|1                  0: every such entry NOT_SUPPORTED (default 1)
 *   fabric STATE STATUS CLIQUE_ID CLUSTER_UUID [HEALTH_MASK [HEALTH_SUMMARY]]
 *                                               nvmlDeviceGetGpuFabricInfo(V)'s answer (STATUS:
 *                                               SUCCESS, an error name or a number; the UUID as
 *                                               32 hex digits, dashes allowed)
 *   fabric none                                 they answer NOT_SUPPORTED (the default: an A100)
 * and, for the library, "clocks_event_slowdown_ids A B C": the field ids of the SW thermal, HW
 * thermal and HW power brake durations (default 269 270 271; 251 252 253 in older headers).
 *
 * If $FAKENVML_STATS names a file, it is created (or truncated) at load time and holds one
 * 64-byte record per exported function, {char name[56]; uint64_t calls;}, counted with
 * atomic increments through a shared mapping, so another process can read the counts at
 * any moment (tests/fakenvml/__init__.py: read_stats) — how the benchmark and the tests
 * count NVML calls per minute of each exporter.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nvml.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_GPUS 256
#define MAX_RULES 32
#define NAME_LEN 96
#define SYNTHETIC_PID_BASE 4000000u
#define MAX_XIDS 64
#define MAX_EVENT_SETS 16
#define MAX_NVLINKS NVML_NVLINK_MAX_LINKS
#define GPM_IDS 128 /* NVML_GPM_METRIC_* ids the fake answers (C2C ends at 101) */
#define GPM_INSTANCES 8
#define MAX_PROCESS_UTIL 64
#define THROTTLE_REASONS 5 /* sw_power_cap, sync_boost, sw/hw thermal, hw power brake */

struct rule {
    char function[64]; /* "*" matches every per-GPU function */
    nvmlReturn_t error; /* NVML_SUCCESS: no error, only a hang */
    double hang_seconds;
};

struct gpu {
    char name[NAME_LEN];
    char uuid[NAME_LEN];
    char pci_bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned long long memory_total, memory_used, memory_reserved;
    unsigned int utilization_gpu, utilization_memory, utilization_encoder, utilization_decoder;
    unsigned int pcie_tx_kbps, pcie_rx_kbps;
    unsigned int power_usage_mw, power_limit_mw, temperature_c, fan_percent;
    unsigned long long energy_mj;
    unsigned int clocks_mhz[4]; /* graphics, sm, memory, video */
    /* What an A100 reports besides: health, limits, PCIe link, modes. */
    unsigned int max_clocks_mhz[4];
    unsigned int temperature_thresholds_c[4]; /* shutdown, slowdown, memory max, GPU max */
    unsigned int power_default_limit_mw, power_min_limit_mw, power_max_limit_mw;
    unsigned long long clocks_event_reasons;
    unsigned int pstate, persistence_mode, compute_mode, ecc_mode;
    unsigned long long ecc[2][2]; /* [corrected, uncorrected][volatile, aggregate] */
    unsigned int remapped_correctable, remapped_uncorrectable, remapped_pending, remapped_failed;
    int retired_pages_supported; /* 0 on an A100: it remaps rows instead */
    unsigned int retired_pages_sbe, retired_pages_dbe, retired_pages_pending;
    unsigned int pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, pcie_replays;
    unsigned int mig_mode, max_mig_devices;
    unsigned long long supported_events;
    unsigned int xid_count; /* Xid events configured so far ("xid" lines), in order */
    unsigned long long xids[MAX_XIDS];
    unsigned int process_count;
    nvmlProcessInfo_t *processes;
    /* Field values only (issue 31): memory temperature, NVLinks. */
    unsigned int memory_temperature_c;
    unsigned int nvlink_links;
    unsigned long long nvlink[MAX_NVLINKS][7]; /* state, tx KiB, rx KiB, 4 error counters */
    struct rule rules[MAX_RULES];
    int rule_count;
    /* GPM and per-process utilization (the block at the end of this file) */
    unsigned int gpm_supported;
    unsigned char gpm_set[GPM_IDS];
    double gpm_values[GPM_IDS];
    unsigned int gpm_instance_count;
    unsigned int gpm_instances[GPM_INSTANCES][2]; /* GPU instance id, SM percent */
    unsigned int process_util_count;
    unsigned int process_util[MAX_PROCESS_UTIL][3]; /* pid, SM percent, memory percent */
    /* Clock event reason durations and fabric info (the block at the end of this file) */
    unsigned int throttle_supported;
    unsigned char throttle_rate_set[THROTTLE_REASONS];
    double throttle_rate[THROTTLE_REASONS];           /* ns per second */
    unsigned long long throttle_start_ns[THROTTLE_REASONS]; /* at library load */
    unsigned int fabric_supported;
    unsigned char fabric_state, fabric_health_summary;
    nvmlReturn_t fabric_status;
    unsigned int fabric_clique_id, fabric_health_mask;
    unsigned char fabric_cluster_uuid[NVML_GPU_FABRIC_UUID_LEN];
};

struct nvmlDevice_st {
    unsigned int index;
};

static struct {
    unsigned int gpu_count;
    char driver_version[NAME_LEN];
    int cuda_driver_version;
    struct rule rules[MAX_RULES]; /* library-level */
    int rule_count;
    struct gpu gpus[MAX_GPUS];
    unsigned int slowdown_field_ids[3]; /* sw thermal, hw thermal, hw power brake */
} config;

static struct nvmlDevice_st handles[MAX_GPUS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static struct stat loaded_stat;
static int loaded;

/* Clock event reason durations and fabric info: the block at the end of this file. */
static int apply_throttle_fabric(struct gpu *g, const char *key, const char *rest);
static void default_throttle_fabric(struct gpu *g);
static void throttle_fold(void);
static void default_slowdown_field_ids(void);
static int throttle_reason(unsigned int field_id);
static unsigned long long throttle_ns(const struct gpu *g, int reason);

/* -- call statistics ------------------------------------------------------------------- */

/* Every exported function, once: the enum of counters and their names come from here. */
#define FUNCTIONS(X)                                                                             \
    X(nvmlInitWithFlags)                                                                        \
    X(nvmlInit_v2)                                                                              \
    X(nvmlShutdown)                                                                             \
    X(nvmlErrorString)                                                                          \
    X(nvmlSystemGetDriverVersion)                                                               \
    X(nvmlSystemGetCudaDriverVersion)                                                           \
    X(nvmlSystemGetCudaDriverVersion_v2)                                                        \
    X(nvmlDeviceGetCount_v2)                                                                    \
    X(nvmlDeviceGetHandleByIndex_v2)                                                            \
    X(nvmlDeviceGetIndex)                                                                       \
    X(nvmlDeviceGetUUID)                                                                        \
    X(nvmlDeviceGetName)                                                                        \
    X(nvmlDeviceGetPciInfo_v3)                                                                  \
    X(nvmlDeviceGetMemoryInfo)                                                                  \
    X(nvmlDeviceGetMemoryInfo_v2)                                                               \
    X(nvmlDeviceGetUtilizationRates)                                                            \
    X(nvmlDeviceGetPowerUsage)                                                                  \
    X(nvmlDeviceGetEnforcedPowerLimit)                                                          \
    X(nvmlDeviceGetPowerManagementLimit)                                                        \
    X(nvmlDeviceGetPowerManagementDefaultLimit)                                                 \
    X(nvmlDeviceGetPowerManagementLimitConstraints)                                             \
    X(nvmlDeviceGetTotalEnergyConsumption)                                                      \
    X(nvmlDeviceGetTemperature)                                                                 \
    X(nvmlDeviceGetTemperatureThreshold)                                                        \
    X(nvmlDeviceGetFanSpeed)                                                                    \
    X(nvmlDeviceGetClockInfo)                                                                   \
    X(nvmlDeviceGetMaxClockInfo)                                                                \
    X(nvmlDeviceGetCurrentClocksEventReasons)                                                   \
    X(nvmlDeviceGetCurrentClocksThrottleReasons)                                                \
    X(nvmlDeviceGetPerformanceState)                                                            \
    X(nvmlDeviceGetPersistenceMode)                                                             \
    X(nvmlDeviceGetComputeMode)                                                                 \
    X(nvmlDeviceGetEccMode)                                                                     \
    X(nvmlDeviceGetTotalEccErrors)                                                              \
    X(nvmlDeviceGetRemappedRows)                                                                \
    X(nvmlDeviceGetRetiredPages)                                                                \
    X(nvmlDeviceGetRetiredPagesPendingStatus)                                                   \
    X(nvmlDeviceGetCurrPcieLinkGeneration)                                                      \
    X(nvmlDeviceGetMaxPcieLinkGeneration)                                                       \
    X(nvmlDeviceGetCurrPcieLinkWidth)                                                           \
    X(nvmlDeviceGetMaxPcieLinkWidth)                                                            \
    X(nvmlDeviceGetPcieReplayCounter)                                                           \
    X(nvmlDeviceGetPcieThroughput)                                                              \
    X(nvmlDeviceGetComputeRunningProcesses_v3)                                                  \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3)                                                 \
    X(nvmlDeviceGetEncoderUtilization)                                                          \
    X(nvmlDeviceGetDecoderUtilization)                                                          \
    X(nvmlGpmQueryDeviceSupport)                                                                \
    X(nvmlGpmSampleAlloc)                                                                       \
    X(nvmlGpmSampleFree)                                                                        \
    X(nvmlGpmSampleGet)                                                                         \
    X(nvmlGpmMigSampleGet)                                                                      \
    X(nvmlGpmMetricsGet)                                                                        \
    X(nvmlDeviceGetProcessUtilization)                                                          \
    X(nvmlDeviceGetMigMode)                                                                     \
    X(nvmlDeviceGetMaxMigDeviceCount)                                                           \
    X(nvmlDeviceGetSupportedEventTypes)                                                         \
    X(nvmlDeviceRegisterEvents)                                                                 \
    X(nvmlEventSetCreate)                                                                       \
    X(nvmlEventSetWait_v2)                                                                      \
    X(nvmlEventSetFree)                                                                         \
    X(nvmlDeviceGetFieldValues)                                                                 \
    X(nvmlDeviceGetGpuFabricInfo)                                                               \
    X(nvmlDeviceGetGpuFabricInfoV)

#define AS_ID(name) F_##name,
#define AS_NAME(name) #name,
enum function_id { FUNCTIONS(AS_ID) F_COUNT };
static const char *const function_names[F_COUNT] = {FUNCTIONS(AS_NAME)};

struct stat_record {
    char name[56];
    uint64_t calls;
};

static struct stat_record *stats;

__attribute__((constructor)) static void open_stats(void)
{
    const char *path = getenv("FAKENVML_STATS");
    if (path == NULL || *path == '\0')
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return;
    size_t size = sizeof(struct stat_record) * F_COUNT;
    if (ftruncate(fd, (off_t)size) == 0) {
        void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map != MAP_FAILED) {
            stats = map;
            for (int i = 0; i < F_COUNT; i++)
                strncpy(stats[i].name, function_names[i], sizeof(stats[i].name) - 1);
        }
    }
    close(fd);
}

static void count(enum function_id id)
{
    if (stats != NULL)
        __atomic_fetch_add(&stats[id].calls, 1, __ATOMIC_RELAXED);
}

/* -- configuration ------------------------------------------------------------------------ */

static const struct {
    const char *name;
    nvmlReturn_t code;
} error_names[] = {
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"INSUFFICIENT_SIZE", NVML_ERROR_INSUFFICIENT_SIZE},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"MEMORY", NVML_ERROR_MEMORY},
    {"NO_DATA", NVML_ERROR_NO_DATA},
    {"ARGUMENT_VERSION_MISMATCH", NVML_ERROR_ARGUMENT_VERSION_MISMATCH},
    {"GPU_NOT_FOUND", NVML_ERROR_GPU_NOT_FOUND},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
};

static nvmlReturn_t parse_error(const char *name)
{
    if (strncmp(name, "NVML_ERROR_", 11) == 0)
        name += 11;
    for (size_t i = 0; i < sizeof(error_names) / sizeof(error_names[0]); i++)
        if (strcmp(name, error_names[i].name) == 0)
            return error_names[i].code;
    fprintf(stderr, "fakenvml: unknown error name %s, using UNKNOWN\n", name);
    return NVML_ERROR_UNKNOWN;
}

static void default_gpu(unsigned int index, struct gpu *g)
{
    free(g->processes);
    memset(g, 0, sizeof(*g));
    snprintf(g->name, sizeof(g->name), "NVIDIA A100-SXM4-80GB");
    snprintf(g->uuid, sizeof(g->uuid), "GPU-fa4e%04x-0000-4000-8000-00000000%04x", index, index);
    snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "00000000:%02X:00.0", (index + 0x10) & 0xff);
    g->memory_total = 80ULL << 30;
    g->memory_reserved = 512ULL << 20;
    g->memory_used = 0;
    g->power_usage_mw = 60000;
    g->power_limit_mw = 400000;
    g->energy_mj = 1000000;
    g->temperature_c = 30;
    g->fan_percent = 0;
    g->clocks_mhz[NVML_CLOCK_GRAPHICS] = 210;
    g->clocks_mhz[NVML_CLOCK_SM] = 210;
    g->clocks_mhz[NVML_CLOCK_MEM] = 1593;
    g->clocks_mhz[NVML_CLOCK_VIDEO] = 795;
    g->max_clocks_mhz[NVML_CLOCK_GRAPHICS] = 1410;
    g->max_clocks_mhz[NVML_CLOCK_SM] = 1410;
    g->max_clocks_mhz[NVML_CLOCK_MEM] = 1593;
    g->max_clocks_mhz[NVML_CLOCK_VIDEO] = 1290;
    g->temperature_thresholds_c[0] = 92; /* shutdown */
    g->temperature_thresholds_c[1] = 89; /* slowdown */
    g->temperature_thresholds_c[2] = 95; /* memory max */
    g->temperature_thresholds_c[3] = 87; /* GPU max */
    g->power_default_limit_mw = 400000;
    g->power_min_limit_mw = 100000;
    g->power_max_limit_mw = 400000;
    g->clocks_event_reasons = 0x1; /* idle */
    g->pstate = 0;
    g->persistence_mode = 1;
    g->compute_mode = 0;
    g->ecc_mode = 1;
    g->pcie_gen = 4;
    g->pcie_gen_max = 4;
    g->pcie_width = 16;
    g->pcie_width_max = 16;
    g->max_mig_devices = 7;
    g->memory_temperature_c = 35;
    for (int link = 0; link < MAX_NVLINKS; link++)
        g->nvlink[link][0] = NVML_NVLINK_STATE_ACTIVE;
    /* Xid, single- and double-bit ECC, P-state and clock events, as an A100 on 550 */
    g->supported_events = nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError |
                          nvmlEventTypeDoubleBitEccError | nvmlEventTypePState |
                          nvmlEventTypeClock;
    default_throttle_fabric(g);
}

static void add_rule(struct rule *rules, int *n, const char *function, nvmlReturn_t error,
                     double hang)
{
    if (*n >= MAX_RULES)
        return;
    struct rule *r = &rules[(*n)++];
    snprintf(r->function, sizeof(r->function), "%s", function);
    r->error = error;
    r->hang_seconds = hang;
}

static void set_processes(struct gpu *g, char *list)
{
    free(g->processes);
    g->processes = NULL;
    g->process_count = 0;
    unsigned int capacity = 0;
    for (char *save = NULL, *item = strtok_r(list, " \t", &save); item != NULL;
         item = strtok_r(NULL, " \t", &save)) {
        unsigned int pid;
        unsigned long long bytes;
        if (sscanf(item, "%u:%llu", &pid, &bytes) != 2)
            continue;
        if (g->process_count == capacity) {
            capacity = capacity ? capacity * 2 : 16;
            g->processes = realloc(g->processes, capacity * sizeof(*g->processes));
        }
        nvmlProcessInfo_t *p = &g->processes[g->process_count++];
        p->pid = pid;
        p->usedGpuMemory = bytes;
        p->gpuInstanceId = 0xFFFFFFFFu;
        p->computeInstanceId = 0xFFFFFFFFu;
    }
}

static void set_synthetic_processes(struct gpu *g, unsigned int index, unsigned int n,
                                    unsigned long long bytes)
{
    free(g->processes);
    g->processes = n ? calloc(n, sizeof(*g->processes)) : NULL;
    g->process_count = n;
    for (unsigned int i = 0; i < n; i++) {
        g->processes[i].pid = SYNTHETIC_PID_BASE + index * 10000u + i;
        g->processes[i].usedGpuMemory = bytes;
        g->processes[i].gpuInstanceId = 0xFFFFFFFFu;
        g->processes[i].computeInstanceId = 0xFFFFFFFFu;
    }
}

/* The A100 keys (see the top of this file): 1 if `key` was one. */
static int apply_health(struct gpu *g, const char *key, const char *rest)
{
    static const struct {
        const char *key;
        size_t offset;
    } uints[] = {
#define U(name, field) {name, offsetof(struct gpu, field)}
        U("clock_max_graphics_mhz", max_clocks_mhz[NVML_CLOCK_GRAPHICS]),
        U("clock_max_sm_mhz", max_clocks_mhz[NVML_CLOCK_SM]),
        U("clock_max_memory_mhz", max_clocks_mhz[NVML_CLOCK_MEM]),
        U("clock_max_video_mhz", max_clocks_mhz[NVML_CLOCK_VIDEO]),
        U("temperature_shutdown_c", temperature_thresholds_c[0]),
        U("temperature_slowdown_c", temperature_thresholds_c[1]),
        U("temperature_memory_max_c", temperature_thresholds_c[2]),
        U("temperature_gpu_max_c", temperature_thresholds_c[3]),
        U("power_default_limit_mw", power_default_limit_mw),
        U("power_min_limit_mw", power_min_limit_mw),
        U("power_max_limit_mw", power_max_limit_mw),
        U("pstate", pstate),
        U("persistence_mode", persistence_mode),
        U("compute_mode", compute_mode),
        U("ecc_mode", ecc_mode),
        U("remapped_correctable", remapped_correctable),
        U("remapped_uncorrectable", remapped_uncorrectable),
        U("remapped_pending", remapped_pending),
        U("remapped_failed", remapped_failed),
        U("pcie_gen", pcie_gen),
        U("pcie_gen_max", pcie_gen_max),
        U("pcie_width", pcie_width),
        U("pcie_width_max", pcie_width_max),
        U("pcie_replays", pcie_replays),
        U("mig_mode", mig_mode),
        U("max_mig_devices", max_mig_devices),
        U("memory_temperature_c", memory_temperature_c),
        U("nvlink_links", nvlink_links),
#undef U
    };
    static const struct {
        const char *key;
        size_t offset;
    } ulls[] = {
#define L(name, field) {name, offsetof(struct gpu, field)}
        L("clocks_event_reasons", clocks_event_reasons),
        L("supported_events", supported_events),
        L("ecc_corrected_volatile", ecc[0][0]),
        L("ecc_corrected_aggregate", ecc[0][1]),
        L("ecc_uncorrected_volatile", ecc[1][0]),
        L("ecc_uncorrected_aggregate", ecc[1][1]),
#undef L
    };
    for (size_t i = 0; i < sizeof(uints) / sizeof(uints[0]); i++)
        if (strcmp(key, uints[i].key) == 0) {
            *(unsigned int *)((char *)g + uints[i].offset) = (unsigned int)strtoul(rest, NULL, 0);
            return 1;
        }
    for (size_t i = 0; i < sizeof(ulls) / sizeof(ulls[0]); i++)
        if (strcmp(key, ulls[i].key) == 0) {
            *(unsigned long long *)((char *)g + ulls[i].offset) = strtoull(rest, NULL, 0);
            return 1;
        }
    if (strcmp(key, "retired_pages") == 0) {
        g->retired_pages_supported = 1;
        sscanf(rest, "%u %u %u", &g->retired_pages_sbe, &g->retired_pages_dbe,
               &g->retired_pages_pending);
        return 1;
    }
    if (strcmp(key, "nvlink") == 0) {
        unsigned int link;
        unsigned long long v[7];
        if (sscanf(rest, "%u %llu %llu %llu %llu %llu %llu %llu", &link, &v[0], &v[1], &v[2],
                   &v[3], &v[4], &v[5], &v[6]) == 8 &&
            link < MAX_NVLINKS)
            memcpy(g->nvlink[link], v, sizeof(v));
        return 1;
    }
    if (strcmp(key, "xid") == 0) {
        if (g->xid_count < MAX_XIDS)
            g->xids[g->xid_count++] = strtoull(rest, NULL, 10);
        return 1;
    }
    return 0;
}

static int apply_gpm(struct gpu *g, const char *key, const char *rest);

/* Apply "KEY VALUE..." to GPU `index`. `rest` is the text after the key. */
static void apply_gpu(unsigned int index, const char *key, char *rest)
{
    struct gpu *g = &config.gpus[index];
    double number;
    if (strcmp(key, "name") == 0)
        snprintf(g->name, sizeof(g->name), "%s", rest);
    else if (strcmp(key, "uuid") == 0)
        snprintf(g->uuid, sizeof(g->uuid), "%s", rest);
    else if (strcmp(key, "pci_bus_id") == 0)
        snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "%s", rest);
    else if (strcmp(key, "memory_total") == 0)
        g->memory_total = strtoull(rest, NULL, 10);
    else if (strcmp(key, "memory_used") == 0)
        g->memory_used = strtoull(rest, NULL, 10);
    else if (strcmp(key, "memory_reserved") == 0)
        g->memory_reserved = strtoull(rest, NULL, 10);
    else if (strcmp(key, "utilization_gpu") == 0)
        g->utilization_gpu = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "utilization_memory") == 0)
        g->utilization_memory = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "utilization_encoder") == 0)
        g->utilization_encoder = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "utilization_decoder") == 0)
        g->utilization_decoder = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "pcie_tx_kbps") == 0)
        g->pcie_tx_kbps = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "pcie_rx_kbps") == 0)
        g->pcie_rx_kbps = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "power_usage_mw") == 0)
        g->power_usage_mw = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "power_limit_mw") == 0)
        g->power_limit_mw = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "energy_mj") == 0)
        g->energy_mj = strtoull(rest, NULL, 10);
    else if (strcmp(key, "temperature_c") == 0)
        g->temperature_c = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "fan_percent") == 0)
        g->fan_percent = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "clock_graphics_mhz") == 0)
        g->clocks_mhz[NVML_CLOCK_GRAPHICS] = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "clock_sm_mhz") == 0)
        g->clocks_mhz[NVML_CLOCK_SM] = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "clock_memory_mhz") == 0)
        g->clocks_mhz[NVML_CLOCK_MEM] = (unsigned int)strtoul(rest, NULL, 10);
    else if (strcmp(key, "clock_video_mhz") == 0)
        g->clocks_mhz[NVML_CLOCK_VIDEO] = (unsigned int)strtoul(rest, NULL, 10);
    else if (apply_health(g, key, rest) || apply_gpm(g, key, rest) ||
             apply_throttle_fabric(g, key, rest))
        ;
    else if (strcmp(key, "processes") == 0) {
        char *copy = strdup(rest);
        set_processes(g, copy);
        free(copy);
    } else if (strcmp(key, "synthetic_processes") == 0) {
        unsigned int n = 0;
        unsigned long long bytes = 0;
        if (sscanf(rest, "%u %llu", &n, &bytes) >= 1)
            set_synthetic_processes(g, index, n, bytes);
    } else if (strcmp(key, "error") == 0) {
        char function[64], name[64];
        if (sscanf(rest, "%63s %63s", function, name) == 2)
            add_rule(g->rules, &g->rule_count, function, parse_error(name), 0.0);
    } else if (strcmp(key, "hang") == 0) {
        char function[64];
        if (sscanf(rest, "%63s %lf", function, &number) == 2)
            add_rule(g->rules, &g->rule_count, function, NVML_SUCCESS, number);
    } else
        fprintf(stderr, "fakenvml: unknown key %s\n", key);
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    return s;
}

static void parse_line(char *line)
{
    char *hash = strchr(line, '#');
    if (hash != NULL)
        *hash = '\0';
    line = trim(line);
    if (*line == '\0')
        return;
    char *save = NULL;
    char *first = strtok_r(line, " \t", &save);
    char *second = strtok_r(NULL, " \t", &save);
    char *rest = save ? trim(save) : "";
    if (second == NULL)
        return;
    if (strcmp(first, "gpus") == 0) {
        unsigned long n = strtoul(second, NULL, 10);
        config.gpu_count = n > MAX_GPUS ? MAX_GPUS : (unsigned int)n;
    } else if (strcmp(first, "driver_version") == 0) {
        snprintf(config.driver_version, sizeof(config.driver_version), "%s", second);
    } else if (strcmp(first, "cuda_driver_version") == 0) {
        config.cuda_driver_version = (int)strtol(second, NULL, 10);
    } else if (strcmp(first, "error") == 0) {
        add_rule(config.rules, &config.rule_count, second, parse_error(rest), 0.0);
    } else if (strcmp(first, "hang") == 0) {
        add_rule(config.rules, &config.rule_count, second, NVML_SUCCESS, strtod(rest, NULL));
    } else if (strcmp(first, "clocks_event_slowdown_ids") == 0) {
        unsigned int ids[3];
        if (sscanf(second, "%u", &ids[0]) == 1 && sscanf(rest, "%u %u", &ids[1], &ids[2]) == 2)
            memcpy(config.slowdown_field_ids, ids, sizeof(ids));
    } else if (strcmp(first, "*") == 0) {
        for (unsigned int i = 0; i < MAX_GPUS; i++) {
            char *copy = strdup(rest);
            apply_gpu(i, second, copy);
            free(copy);
        }
    } else {
        char *end;
        unsigned long index = strtoul(first, &end, 10);
        if (*end != '\0' || index >= MAX_GPUS) {
            fprintf(stderr, "fakenvml: bad line starting %s\n", first);
            return;
        }
        apply_gpu((unsigned int)index, second, rest);
    }
}

/* Re-read the configuration if the file changed. Called with `lock` held. */
static void reload_if_changed(void)
{
    const char *path = getenv("FAKENVML_CONFIG");
    struct stat st;
    if (path == NULL || stat(path, &st) != 0) {
        if (!loaded) {
            throttle_fold();
            default_slowdown_field_ids();
            for (unsigned int i = 0; i < MAX_GPUS; i++)
                default_gpu(i, &config.gpus[i]);
            loaded = 1;
        }
        return;
    }
    if (loaded && st.st_mtim.tv_sec == loaded_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == loaded_stat.st_mtim.tv_nsec && st.st_size == loaded_stat.st_size &&
        st.st_ino == loaded_stat.st_ino)
        return;
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return;
    throttle_fold(); /* the durations so far at the old rates, before they change */
    default_slowdown_field_ids();
    config.gpu_count = 0;
    snprintf(config.driver_version, sizeof(config.driver_version), "550.54.15");
    config.cuda_driver_version = 12040;
    config.rule_count = 0;
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        default_gpu(i, &config.gpus[i]);
    char *line = NULL;
    size_t capacity = 0;
    while (getline(&line, &capacity, f) != -1)
        parse_line(line);
    free(line);
    fclose(f);
    loaded_stat = st;
    loaded = 1;
}

/* -- call plumbing ------------------------------------------------------------------------ */

static void sleep_seconds(double seconds)
{
    if (seconds <= 0)
        return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static nvmlReturn_t match_rules(const struct rule *rules, int n, const char *function,
                                int wildcard, double *hang)
{
    nvmlReturn_t result = NVML_SUCCESS;
    for (int i = 0; i < n; i++) {
        const struct rule *r = &rules[i];
        if (strcmp(r->function, function) != 0 && !(wildcard && strcmp(r->function, "*") == 0))
            continue;
        if (r->hang_seconds > *hang)
            *hang = r->hang_seconds;
        if (r->error != NVML_SUCCESS)
            result = r->error;
    }
    return result;
}

/* Start a library-level call: count it, reload, apply its rules. Leaves `lock` held on
 * NVML_SUCCESS; released otherwise. */
static nvmlReturn_t begin(enum function_id id, int needs_init)
{
    count(id);
    double hang = 0;
    pthread_mutex_lock(&lock);
    reload_if_changed();
    nvmlReturn_t r = match_rules(config.rules, config.rule_count, function_names[id], 0, &hang);
    if (r == NVML_SUCCESS && needs_init && init_count == 0)
        r = NVML_ERROR_UNINITIALIZED;
    if (hang > 0) {
        pthread_mutex_unlock(&lock);
        sleep_seconds(hang);
        pthread_mutex_lock(&lock);
    }
    if (r != NVML_SUCCESS)
        pthread_mutex_unlock(&lock);
    return r;
}

/* Start a per-GPU call: as begin(), plus the handle check and the GPU's rules. On success,
 * `*gpu` is set and `lock` is held. */
static nvmlReturn_t begin_device(enum function_id id, nvmlDevice_t device, struct gpu **gpu)
{
    nvmlReturn_t r = begin(id, 1);
    if (r != NVML_SUCCESS)
        return r;
    if (device < &handles[0] || device >= &handles[MAX_GPUS] ||
        device->index >= config.gpu_count) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    struct gpu *g = &config.gpus[device->index];
    double hang = 0;
    r = match_rules(g->rules, g->rule_count, function_names[id], 1, &hang);
    if (hang > 0) {
        pthread_mutex_unlock(&lock);
        sleep_seconds(hang);
        pthread_mutex_lock(&lock);
        g = &config.gpus[device->index];
    }
    if (r != NVML_SUCCESS) {
        pthread_mutex_unlock(&lock);
        return r;
    }
    *gpu = g;
    return NVML_SUCCESS;
}

static nvmlReturn_t end(nvmlReturn_t r)
{
    pthread_mutex_unlock(&lock);
    return r;
}

static nvmlReturn_t copy_text(char *dest, unsigned int length, const char *text)
{
    if (dest == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dest, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

/* -- the library ---------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t r = begin(F_nvmlInitWithFlags, 0);
    if (r != NVML_SUCCESS)
        return r;
    init_count++;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    nvmlReturn_t r = begin(F_nvmlInit_v2, 0);
    if (r != NVML_SUCCESS)
        return r;
    init_count++;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t r = begin(F_nvmlShutdown, 1);
    if (r != NVML_SUCCESS)
        return r;
    init_count--;
    return end(NVML_SUCCESS);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    count(F_nvmlErrorString);
    if (result == NVML_SUCCESS)
        return "Success";
    for (size_t i = 0; i < sizeof(error_names) / sizeof(error_names[0]); i++)
        if (error_names[i].code == result)
            return error_names[i].name;
    return "Unknown Error";
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = begin(F_nvmlSystemGetDriverVersion, 1);
    if (r != NVML_SUCCESS)
        return r;
    return end(copy_text(version, length, config.driver_version));
}

static nvmlReturn_t cuda_version(enum function_id id, int *version)
{
    nvmlReturn_t r = begin(id, 0); /* the real library answers this without nvmlInit */
    if (r != NVML_SUCCESS)
        return r;
    if (version == NULL)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    *version = config.cuda_driver_version;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    return cuda_version(F_nvmlSystemGetCudaDriverVersion, version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return cuda_version(F_nvmlSystemGetCudaDriverVersion_v2, version);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *device_count)
{
    nvmlReturn_t r = begin(F_nvmlDeviceGetCount_v2, 1);
    if (r != NVML_SUCCESS)
        return r;
    if (device_count == NULL)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    *device_count = config.gpu_count;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = begin(F_nvmlDeviceGetHandleByIndex_v2, 1);
    if (r != NVML_SUCCESS)
        return r;
    if (device == NULL || index >= config.gpu_count)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    double hang = 0;
    struct gpu *g = &config.gpus[index];
    r = match_rules(g->rules, g->rule_count, function_names[F_nvmlDeviceGetHandleByIndex_v2], 1,
                    &hang);
    if (hang > 0) {
        pthread_mutex_unlock(&lock);
        sleep_seconds(hang);
        pthread_mutex_lock(&lock);
    }
    if (r != NVML_SUCCESS)
        return end(r);
    handles[index].index = index;
    *device = &handles[index];
    return end(NVML_SUCCESS);
}

#define DEVICE_CALL(id, device)                                                                  \
    struct gpu *g = NULL;                                                                       \
    nvmlReturn_t r = begin_device(id, device, &g);                                              \
    if (r != NVML_SUCCESS)                                                                      \
        return r;

#define OUT_OF(pointer)                                                                          \
    if ((pointer) == NULL)                                                                      \
        return end(NVML_ERROR_INVALID_ARGUMENT);

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEVICE_CALL(F_nvmlDeviceGetIndex, device)
    OUT_OF(index)
    *index = device->index;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEVICE_CALL(F_nvmlDeviceGetUUID, device)
    return end(copy_text(uuid, length, g->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEVICE_CALL(F_nvmlDeviceGetName, device)
    return end(copy_text(name, length, g->name));
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE_CALL(F_nvmlDeviceGetPciInfo_v3, device)
    OUT_OF(pci)
    memset(pci, 0, sizeof(*pci));
    memcpy(pci->busId, g->pci_bus_id, sizeof(pci->busId));
    /* the legacy field has room for "0000:3B:00.0" only: the domain in 4 digits */
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%.12s", g->pci_bus_id + 4);
    unsigned int domain = 0, bus = 0, dev = 0;
    sscanf(g->pci_bus_id, "%x:%x:%x", &domain, &bus, &dev);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x20B510DE;
    pci->pciSubSystemId = 0x134310DE;
    return end(NVML_SUCCESS);
}

static unsigned long long memory_free(const struct gpu *g)
{
    unsigned long long taken = g->memory_used + g->memory_reserved;
    return taken >= g->memory_total ? 0 : g->memory_total - taken;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEVICE_CALL(F_nvmlDeviceGetMemoryInfo, device)
    OUT_OF(memory)
    /* v1: "used" includes the driver's reservation, as drivers before 510 reported it. */
    memory->total = g->memory_total;
    memory->free = memory_free(g);
    memory->used = g->memory_total - memory->free;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    DEVICE_CALL(F_nvmlDeviceGetMemoryInfo_v2, device)
    OUT_OF(memory)
    if (memory->version != nvmlMemory_v2)
        return end(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = g->memory_total;
    memory->reserved = g->memory_reserved;
    memory->free = memory_free(g);
    memory->used = g->memory_used;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t *utilization)
{
    DEVICE_CALL(F_nvmlDeviceGetUtilizationRates, device)
    OUT_OF(utilization)
    utilization->gpu = g->utilization_gpu;
    utilization->memory = g->utilization_memory;
    return end(NVML_SUCCESS);
}

#define UINT_GETTER(fname, field)                                                                \
    EXPORT nvmlReturn_t fname(nvmlDevice_t device, unsigned int *value)                         \
    {                                                                                           \
        DEVICE_CALL(F_##fname, device)                                                          \
        OUT_OF(value)                                                                           \
        *value = g->field;                                                                      \
        return end(NVML_SUCCESS);                                                               \
    }

UINT_GETTER(nvmlDeviceGetPowerUsage, power_usage_mw)
UINT_GETTER(nvmlDeviceGetEnforcedPowerLimit, power_limit_mw)
UINT_GETTER(nvmlDeviceGetPowerManagementLimit, power_limit_mw)
UINT_GETTER(nvmlDeviceGetFanSpeed, fan_percent)

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long *energy)
{
    DEVICE_CALL(F_nvmlDeviceGetTotalEnergyConsumption, device)
    OUT_OF(energy)
    *energy = g->energy_mj;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensor,
                                             unsigned int *temp)
{
    DEVICE_CALL(F_nvmlDeviceGetTemperature, device)
    OUT_OF(temp)
    if (sensor != NVML_TEMPERATURE_GPU)
        return end(NVML_ERROR_NOT_SUPPORTED);
    *temp = g->temperature_c;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                           unsigned int *clock)
{
    DEVICE_CALL(F_nvmlDeviceGetClockInfo, device)
    OUT_OF(clock)
    if ((unsigned int)type >= 4)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    *clock = g->clocks_mhz[type];
    return end(NVML_SUCCESS);
}

static nvmlReturn_t codec(enum function_id id, nvmlDevice_t device, int decoder,
                          unsigned int *utilization, unsigned int *period_us)
{
    DEVICE_CALL(id, device)
    OUT_OF(utilization)
    OUT_OF(period_us)
    *utilization = decoder ? g->utilization_decoder : g->utilization_encoder;
    *period_us = 167000;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *period_us)
{
    return codec(F_nvmlDeviceGetEncoderUtilization, device, 0, utilization, period_us);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *period_us)
{
    return codec(F_nvmlDeviceGetDecoderUtilization, device, 1, utilization, period_us);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter,
                                                unsigned int *value)
{
    DEVICE_CALL(F_nvmlDeviceGetPcieThroughput, device)
    OUT_OF(value)
    if (counter == NVML_PCIE_UTIL_TX_BYTES)
        *value = g->pcie_tx_kbps;
    else if (counter == NVML_PCIE_UTIL_RX_BYTES)
        *value = g->pcie_rx_kbps;
    else
        return end(NVML_ERROR_INVALID_ARGUMENT);
    return end(NVML_SUCCESS);
}

/* The two-call size protocol: with too small a buffer (or none), say how many entries are
 * needed and answer INSUFFICIENT_SIZE; with no processes, 0 and SUCCESS. */
static nvmlReturn_t processes(const struct gpu *g, unsigned int *count_out,
                              nvmlProcessInfo_t *infos)
{
    if (count_out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int capacity = *count_out;
    *count_out = g->process_count;
    if (g->process_count == 0)
        return NVML_SUCCESS;
    if (infos == NULL || capacity < g->process_count)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(infos, g->processes, g->process_count * sizeof(*infos));
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *info_count,
                                                            nvmlProcessInfo_t *infos)
{
    DEVICE_CALL(F_nvmlDeviceGetComputeRunningProcesses_v3, device)
    return end(processes(g, info_count, infos));
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                             unsigned int *info_count,
                                                             nvmlProcessInfo_t *infos)
{
    DEVICE_CALL(F_nvmlDeviceGetGraphicsRunningProcesses_v3, device)
    (void)g;
    (void)infos;
    if (info_count == NULL)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    *info_count = 0; /* every configured process is a compute process */
    return end(NVML_SUCCESS);
}

/* -- what an A100 reports besides: limits, health, PCIe link, modes ------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                              unsigned int *clock)
{
    DEVICE_CALL(F_nvmlDeviceGetMaxClockInfo, device)
    OUT_OF(clock)
    if ((unsigned int)type >= 4)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    *clock = g->max_clocks_mhz[type];
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device,
                                                      nvmlTemperatureThresholds_t type,
                                                      unsigned int *temp)
{
    DEVICE_CALL(F_nvmlDeviceGetTemperatureThreshold, device)
    OUT_OF(temp)
    switch (type) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
        *temp = g->temperature_thresholds_c[0];
        break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
        *temp = g->temperature_thresholds_c[1];
        break;
    case NVML_TEMPERATURE_THRESHOLD_MEM_MAX:
        *temp = g->temperature_thresholds_c[2];
        break;
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX:
        *temp = g->temperature_thresholds_c[3];
        break;
    default:
        return end(NVML_ERROR_NOT_SUPPORTED);
    }
    return end(NVML_SUCCESS);
}

UINT_GETTER(nvmlDeviceGetPowerManagementDefaultLimit, power_default_limit_mw)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_gen_max)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_width)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_width_max)
UINT_GETTER(nvmlDeviceGetPcieReplayCounter, pcie_replays)
UINT_GETTER(nvmlDeviceGetMaxMigDeviceCount, max_mig_devices)

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device,
                                                                 unsigned int *min_limit,
                                                                 unsigned int *max_limit)
{
    DEVICE_CALL(F_nvmlDeviceGetPowerManagementLimitConstraints, device)
    OUT_OF(min_limit)
    OUT_OF(max_limit)
    *min_limit = g->power_min_limit_mw;
    *max_limit = g->power_max_limit_mw;
    return end(NVML_SUCCESS);
}

static nvmlReturn_t event_reasons(enum function_id id, nvmlDevice_t device,
                                  unsigned long long *reasons)
{
    DEVICE_CALL(id, device)
    OUT_OF(reasons)
    *reasons = g->clocks_event_reasons;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons)
{
    return event_reasons(F_nvmlDeviceGetCurrentClocksEventReasons, device, reasons);
}

/* The older name of the same call, which drivers before 535 have alone. */
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                              unsigned long long *reasons)
{
    return event_reasons(F_nvmlDeviceGetCurrentClocksThrottleReasons, device, reasons);
}

EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, nvmlPstates_t *pstate)
{
    DEVICE_CALL(F_nvmlDeviceGetPerformanceState, device)
    OUT_OF(pstate)
    *pstate = (nvmlPstates_t)g->pstate;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    DEVICE_CALL(F_nvmlDeviceGetPersistenceMode, device)
    OUT_OF(mode)
    *mode = g->persistence_mode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    DEVICE_CALL(F_nvmlDeviceGetComputeMode, device)
    OUT_OF(mode)
    *mode = (nvmlComputeMode_t)g->compute_mode;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current,
                                         nvmlEnableState_t *pending)
{
    DEVICE_CALL(F_nvmlDeviceGetEccMode, device)
    OUT_OF(current)
    OUT_OF(pending)
    *current = *pending = g->ecc_mode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device,
                                                nvmlMemoryErrorType_t error_type,
                                                nvmlEccCounterType_t counter_type,
                                                unsigned long long *count_out)
{
    DEVICE_CALL(F_nvmlDeviceGetTotalEccErrors, device)
    OUT_OF(count_out)
    if ((unsigned int)error_type > 1 || (unsigned int)counter_type > 1)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->ecc_mode)
        return end(NVML_ERROR_NOT_SUPPORTED);
    *count_out = g->ecc[error_type][counter_type];
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corr_rows,
                                              unsigned int *unc_rows, unsigned int *is_pending,
                                              unsigned int *failure_occurred)
{
    DEVICE_CALL(F_nvmlDeviceGetRemappedRows, device)
    OUT_OF(corr_rows)
    OUT_OF(unc_rows)
    OUT_OF(is_pending)
    OUT_OF(failure_occurred)
    *corr_rows = g->remapped_correctable;
    *unc_rows = g->remapped_uncorrectable;
    *is_pending = g->remapped_pending;
    *failure_occurred = g->remapped_failed;
    return end(NVML_SUCCESS);
}

/* An A100 answers NOT_SUPPORTED (it remaps rows); with "retired_pages", pages at made-up
 * addresses, through the same two-call size protocol as the process lists. */
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device,
                                              nvmlPageRetirementCause_t cause,
                                              unsigned int *page_count,
                                              unsigned long long *addresses)
{
    DEVICE_CALL(F_nvmlDeviceGetRetiredPages, device)
    OUT_OF(page_count)
    if (!g->retired_pages_supported)
        return end(NVML_ERROR_NOT_SUPPORTED);
    unsigned int n = cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
                         ? g->retired_pages_sbe
                         : g->retired_pages_dbe;
    unsigned int capacity = *page_count;
    *page_count = n;
    if (n == 0)
        return end(NVML_SUCCESS);
    if (addresses == NULL || capacity < n)
        return end(NVML_ERROR_INSUFFICIENT_SIZE);
    for (unsigned int i = 0; i < n; i++)
        addresses[i] = 0x1000ULL * (i + 1) + (cause ? 0x100000ULL : 0);
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                           nvmlEnableState_t *pending)
{
    DEVICE_CALL(F_nvmlDeviceGetRetiredPagesPendingStatus, device)
    OUT_OF(pending)
    if (!g->retired_pages_supported)
        return end(NVML_ERROR_NOT_SUPPORTED);
    *pending = g->retired_pages_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                         unsigned int *pending)
{
    DEVICE_CALL(F_nvmlDeviceGetMigMode, device)
    OUT_OF(current)
    OUT_OF(pending)
    *current = *pending = g->mig_mode;
    return end(NVML_SUCCESS);
}

/* -- events --------------------------------------------------------------------------------- */

struct nvmlEventSet_st {
    int used;
    unsigned long long registered[MAX_GPUS]; /* event types per GPU */
    unsigned int delivered[MAX_GPUS];        /* Xid events of that GPU handed out so far */
};

static struct nvmlEventSet_st event_sets[MAX_EVENT_SETS];

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *event_types)
{
    DEVICE_CALL(F_nvmlDeviceGetSupportedEventTypes, device)
    OUT_OF(event_types)
    *event_types = g->supported_events;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t r = begin(F_nvmlEventSetCreate, 1);
    if (r != NVML_SUCCESS)
        return r;
    OUT_OF(set)
    for (int i = 0; i < MAX_EVENT_SETS; i++)
        if (!event_sets[i].used) {
            memset(&event_sets[i], 0, sizeof(event_sets[i]));
            event_sets[i].used = 1;
            *set = &event_sets[i];
            return end(NVML_SUCCESS);
        }
    return end(NVML_ERROR_MEMORY);
}

static int valid_set(nvmlEventSet_t set)
{
    return set >= &event_sets[0] && set < &event_sets[MAX_EVENT_SETS] && set->used;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long event_types,
                                             nvmlEventSet_t set)
{
    DEVICE_CALL(F_nvmlDeviceRegisterEvents, device)
    if (!valid_set(set))
        return end(NVML_ERROR_INVALID_ARGUMENT);
    if (event_types & ~g->supported_events)
        return end(NVML_ERROR_NOT_SUPPORTED);
    set->registered[device->index] |= event_types;
    set->delivered[device->index] = g->xid_count; /* only events from now on */
    return end(NVML_SUCCESS);
}

/* The next configured Xid event of a GPU registered in `set`, or 0. Called with `lock` held. */
static int next_xid(nvmlEventSet_t set, nvmlEventData_t *data)
{
    for (unsigned int i = 0; i < config.gpu_count; i++) {
        struct gpu *g = &config.gpus[i];
        if (!(set->registered[i] & nvmlEventTypeXidCriticalError))
            continue;
        if (set->delivered[i] > g->xid_count)
            set->delivered[i] = g->xid_count; /* the file was rewritten with fewer */
        if (set->delivered[i] < g->xid_count) {
            handles[i].index = i;
            data->device = &handles[i];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = g->xids[set->delivered[i]++];
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return 1;
        }
    }
    return 0;
}

/* Blocks up to `timeout_ms` (in one sleep, as the driver's wait costs no CPU) for the next
 * Xid event; events configured while it sleeps are seen by the next call. */
EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeout_ms)
{
    nvmlReturn_t r = begin(F_nvmlEventSetWait_v2, 1);
    if (r != NVML_SUCCESS)
        return r;
    OUT_OF(data)
    if (!valid_set(set))
        return end(NVML_ERROR_INVALID_ARGUMENT);
    if (next_xid(set, data))
        return end(NVML_SUCCESS);
    pthread_mutex_unlock(&lock);
    sleep_seconds(timeout_ms / 1000.0);
    pthread_mutex_lock(&lock);
    reload_if_changed();
    if (valid_set(set) && next_xid(set, data))
        return end(NVML_SUCCESS);
    return end(NVML_ERROR_TIMEOUT);
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t r = begin(F_nvmlEventSetFree, 1);
    if (r != NVML_SUCCESS)
        return r;
    if (!valid_set(set))
        return end(NVML_ERROR_INVALID_ARGUMENT);
    set->used = 0;
    return end(NVML_SUCCESS);
}

/* -- field values (issue 31) ------------------------------------------------------------------ */

/* The getter whose rules a field follows (it is the same value), or NULL. */
static const char *field_getter(unsigned int id)
{
    switch (id) {
    case NVML_FI_DEV_POWER_AVERAGE:
    case NVML_FI_DEV_POWER_INSTANT:
        return "nvmlDeviceGetPowerUsage";
    case NVML_FI_DEV_POWER_CURRENT_LIMIT:
        return "nvmlDeviceGetEnforcedPowerLimit";
    case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        return "nvmlDeviceGetTotalEnergyConsumption";
    case NVML_FI_DEV_GPU_TEMP:
        return "nvmlDeviceGetTemperature";
    case NVML_FI_DEV_ECC_CURRENT:
        return "nvmlDeviceGetEccMode";
    case NVML_FI_DEV_ECC_SBE_VOL_TOTAL:
    case NVML_FI_DEV_ECC_DBE_VOL_TOTAL:
    case NVML_FI_DEV_ECC_SBE_AGG_TOTAL:
    case NVML_FI_DEV_ECC_DBE_AGG_TOTAL:
        return "nvmlDeviceGetTotalEccErrors";
    case NVML_FI_DEV_RETIRED_SBE:
    case NVML_FI_DEV_RETIRED_DBE:
        return "nvmlDeviceGetRetiredPages";
    case NVML_FI_DEV_RETIRED_PENDING:
        return "nvmlDeviceGetRetiredPagesPendingStatus";
    case NVML_FI_DEV_REMAPPED_COR:
    case NVML_FI_DEV_REMAPPED_UNC:
    case NVML_FI_DEV_REMAPPED_PENDING:
    case NVML_FI_DEV_REMAPPED_FAILURE:
        return "nvmlDeviceGetRemappedRows";
    case NVML_FI_DEV_PCIE_REPLAY_COUNTER:
        return "nvmlDeviceGetPcieReplayCounter";
    default:
        return NULL;
    }
}

/* Which of a link's seven counters a per-link field is, or -1. */
static int nvlink_counter(unsigned int id)
{
    switch (id) {
    case NVML_FI_DEV_NVLINK_GET_STATE:
        return 0;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
        return 1;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
        return 2;
    case NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL:
        return 3;
    case NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL:
        return 4;
    case NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL:
        return 5;
    case NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL:
        return 6;
    default:
        return -1;
    }
}

#define ANSWER(type, member, v)                                                                  \
    do {                                                                                        \
        f->valueType = (type);                                                                  \
        f->value.member = (v);                                                                  \
        return NVML_SUCCESS;                                                                    \
    } while (0)

/* One entry, as the driver answers it. */
static nvmlReturn_t field_value(const struct gpu *g, nvmlFieldValue_t *f)
{
    int reason = throttle_reason(f->fieldId);
    if (reason >= 0) {
        if (!g->throttle_supported)
            return NVML_ERROR_NOT_SUPPORTED;
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, ullVal, throttle_ns(g, reason));
    }
    int counter = nvlink_counter(f->fieldId);
    if (counter >= 0) {
        if (g->nvlink_links == 0)
            return NVML_ERROR_NOT_SUPPORTED;
        if (f->scopeId >= g->nvlink_links)
            return NVML_ERROR_INVALID_ARGUMENT;
        if (counter == 0)
            ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, (unsigned int)g->nvlink[f->scopeId][0]);
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, ullVal, g->nvlink[f->scopeId][counter]);
    }
    switch (f->fieldId) {
    case NVML_FI_DEV_POWER_AVERAGE:
    case NVML_FI_DEV_POWER_INSTANT:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->power_usage_mw);
    case NVML_FI_DEV_POWER_CURRENT_LIMIT:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->power_limit_mw);
    case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, ullVal, g->energy_mj);
    case NVML_FI_DEV_GPU_TEMP:
        ANSWER(NVML_VALUE_TYPE_DOUBLE, dVal, (double)g->temperature_c);
    case NVML_FI_DEV_MEMORY_TEMP:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->memory_temperature_c);
    case NVML_FI_DEV_ECC_CURRENT:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->ecc_mode ? 1u : 0u);
    case NVML_FI_DEV_ECC_SBE_VOL_TOTAL:
    case NVML_FI_DEV_ECC_DBE_VOL_TOTAL:
    case NVML_FI_DEV_ECC_SBE_AGG_TOTAL:
    case NVML_FI_DEV_ECC_DBE_AGG_TOTAL: {
        if (!g->ecc_mode)
            return NVML_ERROR_NOT_SUPPORTED;
        unsigned int k = f->fieldId - NVML_FI_DEV_ECC_SBE_VOL_TOTAL; /* SBE VOL, DBE VOL, ... */
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, ullVal, g->ecc[k % 2][k / 2]);
    }
    case NVML_FI_DEV_RETIRED_SBE:
    case NVML_FI_DEV_RETIRED_DBE:
    case NVML_FI_DEV_RETIRED_PENDING:
        if (!g->retired_pages_supported)
            return NVML_ERROR_NOT_SUPPORTED;
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal,
               f->fieldId == NVML_FI_DEV_RETIRED_SBE   ? g->retired_pages_sbe
               : f->fieldId == NVML_FI_DEV_RETIRED_DBE ? g->retired_pages_dbe
                                                       : g->retired_pages_pending);
    case NVML_FI_DEV_REMAPPED_COR:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->remapped_correctable);
    case NVML_FI_DEV_REMAPPED_UNC:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->remapped_uncorrectable);
    case NVML_FI_DEV_REMAPPED_PENDING:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->remapped_pending);
    case NVML_FI_DEV_REMAPPED_FAILURE:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->remapped_failed);
    case NVML_FI_DEV_PCIE_REPLAY_COUNTER:
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->pcie_replays);
    case NVML_FI_DEV_NVLINK_LINK_COUNT:
        if (g->nvlink_links == 0)
            return NVML_ERROR_NOT_SUPPORTED;
        ANSWER(NVML_VALUE_TYPE_UNSIGNED_INT, uiVal, g->nvlink_links);
    default:
        return NVML_ERROR_NOT_SUPPORTED;
    }
}

/* Each entry answered alone: its own nvmlReturn; the call fails only as a whole (its rules,
 * a bad handle or array). The rules of the getter behind an entry apply to that entry. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count,
                                             nvmlFieldValue_t *values)
{
    DEVICE_CALL(F_nvmlDeviceGetFieldValues, device)
    if (values == NULL || count < 0)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    double hang = 0;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *f = &values[i];
        char own[32];
        snprintf(own, sizeof(own), "field:%u", f->fieldId);
        const char *getter = field_getter(f->fieldId);
        nvmlReturn_t r = match_rules(g->rules, g->rule_count, own, 0, &hang);
        if (r == NVML_SUCCESS && getter != NULL)
            r = match_rules(g->rules, g->rule_count, getter, 0, &hang);
        f->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        f->latencyUsec = 0;
        f->nvmlReturn = r == NVML_SUCCESS ? field_value(g, f) : r;
    }
    if (hang > 0) {
        pthread_mutex_unlock(&lock);
        sleep_seconds(hang);
        pthread_mutex_lock(&lock);
    }
    return end(NVML_SUCCESS);
}

/* -- GPM and per-process utilization ---------------------------------------------------------
 * Structs and version numbers are nvml.h's own: nvmlGpmSupport_t (NVML_GPM_SUPPORT_VERSION),
 * nvmlGpmMetricsGet_t (NVML_GPM_METRICS_GET_VERSION, metrics[NVML_GPM_METRIC_MAX]), and the
 * opaque nvmlGpmSample_t, which here records whose counters it holds. */

#define GPM_SAMPLE_MAGIC 0x47504d53u

struct nvmlGpmSample_st {
    unsigned int magic;
    int gpu;      /* -1 until filled */
    int instance; /* MIG GPU instance id, -1 for the whole GPU */
};

static int apply_gpm(struct gpu *g, const char *key, const char *rest)
{
    if (strcmp(key, "gpm_supported") == 0) {
        g->gpm_supported = (unsigned int)strtoul(rest, NULL, 0);
        return 1;
    }
    if (strcmp(key, "gpm") == 0) {
        unsigned int id;
        double value;
        if (sscanf(rest, "%u %lf", &id, &value) == 2 && id < GPM_IDS) {
            g->gpm_set[id] = 1;
            g->gpm_values[id] = value;
        }
        return 1;
    }
    if (strcmp(key, "gpm_instances") == 0 || strcmp(key, "process_utilization") == 0) {
        int instances = key[1] == 'p';
        char *copy = strdup(rest);
        if (instances)
            g->gpm_instance_count = 0;
        else
            g->process_util_count = 0;
        for (char *save = NULL, *item = strtok_r(copy, " \t", &save); item != NULL;
             item = strtok_r(NULL, " \t", &save)) {
            unsigned int a, b, c = 0;
            if (instances && sscanf(item, "%u:%u", &a, &b) == 2 &&
                g->gpm_instance_count < GPM_INSTANCES) {
                g->gpm_instances[g->gpm_instance_count][0] = a;
                g->gpm_instances[g->gpm_instance_count++][1] = b;
            } else if (!instances && sscanf(item, "%u:%u:%u", &a, &b, &c) >= 2 &&
                       g->process_util_count < MAX_PROCESS_UTIL) {
                unsigned int *p = g->process_util[g->process_util_count++];
                p[0] = a;
                p[1] = b;
                p[2] = c;
            }
        }
        free(copy);
        return 1;
    }
    return 0;
}

EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support)
{
    DEVICE_CALL(F_nvmlGpmQueryDeviceSupport, device)
    OUT_OF(support)
    if (support->version != NVML_GPM_SUPPORT_VERSION)
        return end(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    support->isSupportedDevice = g->gpm_supported ? 1 : 0;
    return end(NVML_SUCCESS);
}

static int valid_sample(nvmlGpmSample_t sample)
{
    return sample != NULL && sample->magic == GPM_SAMPLE_MAGIC;
}

EXPORT nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample)
{
    nvmlReturn_t r = begin(F_nvmlGpmSampleAlloc, 1);
    if (r != NVML_SUCCESS)
        return r;
    OUT_OF(sample)
    struct nvmlGpmSample_st *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return end(NVML_ERROR_MEMORY);
    s->magic = GPM_SAMPLE_MAGIC;
    s->gpu = s->instance = -1;
    *sample = s;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample)
{
    /* No init needed: buffers outlive a shutdown, and are freed after one. */
    nvmlReturn_t r = begin(F_nvmlGpmSampleFree, 0);
    if (r != NVML_SUCCESS)
        return r;
    if (!valid_sample(sample))
        return end(NVML_ERROR_INVALID_ARGUMENT);
    sample->magic = 0;
    free(sample);
    return end(NVML_SUCCESS);
}

static nvmlReturn_t gpm_fill(enum function_id id, nvmlDevice_t device, int instance,
                             nvmlGpmSample_t sample)
{
    DEVICE_CALL(id, device)
    if (!valid_sample(sample))
        return end(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->gpm_supported)
        return end(NVML_ERROR_NOT_SUPPORTED);
    if (instance >= 0) {
        unsigned int i = 0;
        while (i < g->gpm_instance_count && g->gpm_instances[i][0] != (unsigned int)instance)
            i++;
        if (i == g->gpm_instance_count)
            return end(NVML_ERROR_NOT_FOUND);
    }
    sample->gpu = (int)device->index;
    sample->instance = instance;
    return end(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample)
{
    return gpm_fill(F_nvmlGpmSampleGet, device, -1, sample);
}

EXPORT nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId,
                                        nvmlGpmSample_t sample)
{
    return gpm_fill(F_nvmlGpmMigSampleGet, device, (int)gpuInstanceId, sample);
}

/* Each metric answers its own return code: the configured value (a constant rate), or
 * NOT_SUPPORTED in that entry alone. The GPU's rules for nvmlGpmMetricsGet apply. */
EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *request)
{
    nvmlReturn_t r = begin(F_nvmlGpmMetricsGet, 1);
    if (r != NVML_SUCCESS)
        return r;
    OUT_OF(request)
    if (request->version != NVML_GPM_METRICS_GET_VERSION)
        return end(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (request->numMetrics > NVML_GPM_METRIC_MAX || !valid_sample(request->sample1) ||
        !valid_sample(request->sample2))
        return end(NVML_ERROR_INVALID_ARGUMENT);
    nvmlGpmSample_t s1 = request->sample1, s2 = request->sample2;
    if (s1->gpu < 0 || s1->gpu != s2->gpu || s1->instance != s2->instance ||
        (unsigned int)s1->gpu >= config.gpu_count)
        return end(NVML_ERROR_INVALID_ARGUMENT);
    struct gpu *g = &config.gpus[s1->gpu];
    double hang = 0;
    r = match_rules(g->rules, g->rule_count, function_names[F_nvmlGpmMetricsGet], 1, &hang);
    if (hang > 0) {
        pthread_mutex_unlock(&lock);
        sleep_seconds(hang);
        pthread_mutex_lock(&lock);
        g = &config.gpus[s1->gpu];
    }
    if (r != NVML_SUCCESS)
        return end(r);
    for (unsigned int i = 0; i < request->numMetrics; i++) {
        nvmlGpmMetric_t *m = &request->metrics[i];
        unsigned int metric = m->metricId;
        m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        m->value = 0;
        m->metricInfo.shortName = m->metricInfo.longName = m->metricInfo.unit = NULL;
        if (s1->instance >= 0) {
            for (unsigned int k = 0; k < g->gpm_instance_count; k++)
                if (g->gpm_instances[k][0] == (unsigned int)s1->instance &&
                    metric == NVML_GPM_METRIC_SM_UTIL) {
                    m->nvmlReturn = NVML_SUCCESS;
                    m->value = g->gpm_instances[k][1];
                }
        } else if (metric < GPM_IDS && g->gpm_set[metric]) {
            m->nvmlReturn = NVML_SUCCESS;
            m->value = g->gpm_values[metric];
        }
    }
    return end(NVML_SUCCESS);
}

/* The two-call size protocol, and NOT_FOUND when no process did anything. */
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                    nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *count,
                                                    unsigned long long last_seen)
{
    DEVICE_CALL(F_nvmlDeviceGetProcessUtilization, device)
    OUT_OF(count)
    if (g->process_util_count == 0)
        return end(NVML_ERROR_NOT_FOUND);
    unsigned int capacity = *count;
    *count = g->process_util_count;
    if (utilization == NULL || capacity < g->process_util_count)
        return end(NVML_ERROR_INSUFFICIENT_SIZE);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned long long stamp = (unsigned long long)now.tv_sec * 1000000ull + now.tv_nsec / 1000;
    if (stamp <= last_seen)
        stamp = last_seen + 1;
    for (unsigned int i = 0; i < g->process_util_count; i++) {
        nvmlProcessUtilizationSample_t *u = &utilization[i];
        memset(u, 0, sizeof(*u));
        u->pid = g->process_util[i][0];
        u->timeStamp = stamp;
        u->smUtil = g->process_util[i][1];
        u->memUtil = g->process_util[i][2];
    }
    return end(NVML_SUCCESS);
}

/* -- clock event reason durations and fabric info ---------------------------------------------
 * The durations: nvmlDeviceGetFieldValues' NVML_FI_DEV_CLOCKS_EVENT_REASON_* entries, each the
 * nanoseconds that reason has held the clocks down since the driver loaded: here, since this
 * process loaded the library (CLOCK_MONOTONIC), at each GPU's rate per reason. A new file's
 * rates apply from the moment the library notices it; the time before is kept at the old
 * rates, so a duration never goes backwards while the library stays loaded.
 *
 * The fabric: nvmlDeviceGetGpuFabricInfo (nvmlGpuFabricInfo_t) and nvmlDeviceGetGpuFabricInfoV
 * (nvmlGpuFabricInfo_v2_t or _v3_t, by its version field; any other: ARGUMENT_VERSION_MISMATCH).
 * Structs and version numbers are nvml.h's own. */

enum { SW_POWER_CAP, SYNC_BOOST, SW_THERM_SLOWDOWN, HW_THERM_SLOWDOWN, HW_POWER_BRAKE_SLOWDOWN };

static const char *const throttle_names[THROTTLE_REASONS] = {
    "sw_power_cap", "sync_boost", "sw_therm_slowdown", "hw_therm_slowdown",
    "hw_power_brake_slowdown",
};

/* nvmlClocksEventReason* bits: SwPowerCap, SyncBoost, SwThermalSlowdown, HwThermalSlowdown,
 * HwPowerBrakeSlowdown */
static const unsigned long long throttle_bits[THROTTLE_REASONS] = {0x4, 0x10, 0x20, 0x40, 0x80};

/* A GPU under load (utilization_gpu > 0) with no rate of its own and no SW power cap in its
 * current reasons touches its power cap now and then: 5 ms a second. */
#define LOADED_SW_POWER_CAP_NS_PER_S 5e6

static double throttle_accrued_ns[MAX_GPUS][THROTTLE_REASONS];
static struct timespec throttle_since;
static int throttle_started;

/* The slowdown reasons' ids are 269, 270 and 271 in nvml.h since nvidia-nvml-dev 13.0.87 and
 * in nvidia-ml-py since 13.580.82; nvml.h 13.0.39 and nvidia-ml-py 12.575.51 to 13.580.65
 * number them 251, 252 and 253, ids that power smoothing has now ("clocks_event_slowdown_ids").
 * Taken as numbers, not from the header the library is built against, so the ids it answers
 * do not depend on which nvidia-nvml-dev is installed. */
static void default_slowdown_field_ids(void)
{
    config.slowdown_field_ids[0] = 269;
    config.slowdown_field_ids[1] = 270;
    config.slowdown_field_ids[2] = 271;
}

static int throttle_reason(unsigned int field_id)
{
    switch (field_id) {
    case NVML_FI_DEV_PERF_POLICY_POWER: /* = NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP */
        return SW_POWER_CAP;
    case NVML_FI_DEV_PERF_POLICY_SYNC_BOOST: /* = ..._SYNC_BOOST */
        return SYNC_BOOST;
    case NVML_FI_DEV_PERF_POLICY_THERMAL: /* the older id of the SW thermal counter */
        return SW_THERM_SLOWDOWN;
    default:
        for (int k = 0; k < 3; k++)
            if (field_id == config.slowdown_field_ids[k])
                return SW_THERM_SLOWDOWN + k;
        return -1;
    }
}

static double throttle_rate(const struct gpu *g, int reason)
{
    if (g->throttle_rate_set[reason])
        return g->throttle_rate[reason];
    if (g->clocks_event_reasons & throttle_bits[reason])
        return 1e9; /* a reason that holds the clocks now has held them all along */
    if (reason == SW_POWER_CAP && g->utilization_gpu > 0)
        return LOADED_SW_POWER_CAP_NS_PER_S;
    return 0;
}

static double seconds_since(const struct timespec *then, const struct timespec *now)
{
    return (double)(now->tv_sec - then->tv_sec) + (double)(now->tv_nsec - then->tv_nsec) / 1e9;
}

/* Add the time since the last fold at the current rates. Called with `lock` held, before a
 * new configuration replaces the rates. */
static void throttle_fold(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (throttle_started) {
        double elapsed = seconds_since(&throttle_since, &now);
        for (unsigned int i = 0; i < MAX_GPUS; i++)
            for (int r = 0; r < THROTTLE_REASONS; r++)
                throttle_accrued_ns[i][r] += throttle_rate(&config.gpus[i], r) * elapsed;
    }
    throttle_since = now;
    throttle_started = 1;
}

static unsigned long long throttle_ns(const struct gpu *g, int reason)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    size_t index = (size_t)(g - config.gpus);
    double accrued = throttle_accrued_ns[index][reason] +
                     throttle_rate(g, reason) * seconds_since(&throttle_since, &now);
    return g->throttle_start_ns[reason] + (unsigned long long)accrued;
}

static void default_throttle_fabric(struct gpu *g)
{
    g->throttle_supported = 1;
    g->fabric_supported = 0; /* an A100: fabric info is Hopper's and later */
    g->fabric_state = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED;
    g->fabric_status = NVML_SUCCESS;
}

static int parse_reason(const char *name)
{
    for (int r = 0; r < THROTTLE_REASONS; r++)
        if (strcmp(name, throttle_names[r]) == 0)
            return r;
    fprintf(stderr, "fakenvml: unknown clock event reason %s\n", name);
    return -1;
}

/* "8c3f...-..." or 32 hex digits, dashes anywhere, into 16 bytes; 0 if it is not that. */
static int parse_uuid(const char *text, unsigned char out[NVML_GPU_FABRIC_UUID_LEN])
{
    unsigned char bytes[NVML_GPU_FABRIC_UUID_LEN];
    int digits = 0;
    for (const char *c = text; *c != '\0'; c++) {
        if (*c == '-')
            continue;
        int v = *c >= '0' && *c <= '9'   ? *c - '0'
                : *c >= 'a' && *c <= 'f' ? *c - 'a' + 10
                : *c >= 'A' && *c <= 'F' ? *c - 'A' + 10
                                         : -1;
        if (v < 0 || digits >= 2 * NVML_GPU_FABRIC_UUID_LEN)
            return 0;
        if (digits % 2 == 0)
            bytes[digits / 2] = (unsigned char)(v << 4);
        else
            bytes[digits / 2] |= (unsigned char)v;
        digits++;
    }
    if (digits != 2 * NVML_GPU_FABRIC_UUID_LEN)
        return 0;
    memcpy(out, bytes, sizeof(bytes));
    return 1;
}

static nvmlReturn_t parse_status(const char *text)
{
    if (*text >= '0' && *text <= '9')
        return (nvmlReturn_t)strtol(text, NULL, 0);
    if (strcmp(text, "SUCCESS") == 0 || strcmp(text, "NVML_SUCCESS") == 0)
        return NVML_SUCCESS;
    return parse_error(text);
}

static int apply_throttle_fabric(struct gpu *g, const char *key, const char *rest)
{
    if (strcmp(key, "clocks_event_durations") == 0) {
        g->throttle_supported = (unsigned int)strtoul(rest, NULL, 0);
        return 1;
    }
    if (strcmp(key, "clocks_event_rate") == 0) {
        char name[64];
        double rate;
        int r;
        if (sscanf(rest, "%63s %lf", name, &rate) == 2 && (r = parse_reason(name)) >= 0) {
            g->throttle_rate_set[r] = 1;
            g->throttle_rate[r] = rate > 0 ? rate : 0;
        }
        return 1;
    }
    if (strcmp(key, "clocks_event_ns") == 0) {
        char name[64];
        unsigned long long ns;
        int r;
        if (sscanf(rest, "%63s %llu", name, &ns) == 2 && (r = parse_reason(name)) >= 0)
            g->throttle_start_ns[r] = ns;
        return 1;
    }
    if (strcmp(key, "fabric") == 0) {
        unsigned int state, clique, mask = 0, summary = 0;
        char status[64], uuid[64];
        if (strcmp(rest, "none") == 0) {
            g->fabric_supported = 0;
        } else if (sscanf(rest, "%u %63s %u %63s %u %u", &state, status, &clique, uuid, &mask,
                          &summary) >= 4 &&
                   parse_uuid(uuid, g->fabric_cluster_uuid)) {
            g->fabric_supported = 1;
            g->fabric_state = (unsigned char)state;
            g->fabric_status = parse_status(status);
            g->fabric_clique_id = clique;
            g->fabric_health_mask = mask;
            g->fabric_health_summary = (unsigned char)summary;
        } else {
            fprintf(stderr, "fakenvml: bad fabric line %s\n", rest);
        }
        return 1;
    }
    return 0;
}

/* The first fields every version shares, as the driver fills them. */
#define FILL_FABRIC(info, g)                                                                      \
    do {                                                                                        \
        memcpy((info)->clusterUuid, (g)->fabric_cluster_uuid, NVML_GPU_FABRIC_UUID_LEN);         \
        (info)->status = (g)->fabric_status;                                                    \
        (info)->cliqueId = (g)->fabric_clique_id;                                               \
        (info)->state = (g)->fabric_state;                                                      \
    } while (0)

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device,
                                               nvmlGpuFabricInfo_t *gpuFabricInfo)
{
    DEVICE_CALL(F_nvmlDeviceGetGpuFabricInfo, device)
    OUT_OF(gpuFabricInfo)
    if (!g->fabric_supported)
        return end(NVML_ERROR_NOT_SUPPORTED);
    FILL_FABRIC(gpuFabricInfo, g);
    return end(NVML_SUCCESS);
}

/* v2 (what nvidia-ml-py passes) or v3 (nvml.h's nvmlGpuFabricInfoV_t, with healthSummary):
 * only the caller's version's bytes are written. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device,
                                                nvmlGpuFabricInfoV_t *gpuFabricInfo)
{
    DEVICE_CALL(F_nvmlDeviceGetGpuFabricInfoV, device)
    OUT_OF(gpuFabricInfo)
    unsigned int version = gpuFabricInfo->version;
    if (version != nvmlGpuFabricInfo_v2 && version != nvmlGpuFabricInfo_v3)
        return end(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (!g->fabric_supported)
        return end(NVML_ERROR_NOT_SUPPORTED);
    nvmlGpuFabricInfo_v2_t *v2 = (nvmlGpuFabricInfo_v2_t *)gpuFabricInfo;
    FILL_FABRIC(v2, g);
    v2->healthMask = g->fabric_health_mask;
    if (version == nvmlGpuFabricInfo_v3)
        gpuFabricInfo->healthSummary = g->fabric_health_summary;
    return end(NVML_SUCCESS);
}
