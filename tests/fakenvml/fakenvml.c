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
 * If $FAKENVML_STATS names a file, it is created (or truncated) at load time and holds one
 * 64-byte record per exported function, {char name[56]; uint64_t calls;}, counted with
 * atomic increments through a shared mapping, so another process can read the counts at
 * any moment.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
    unsigned int process_count;
    nvmlProcessInfo_t *processes;
    struct rule rules[MAX_RULES];
    int rule_count;
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
} config;

static struct nvmlDevice_st handles[MAX_GPUS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static struct stat loaded_stat;
static int loaded;

/* -- call statistics ------------------------------------------------------------------- */

enum function_id {
    F_nvmlInitWithFlags,
    F_nvmlInit_v2,
    F_nvmlShutdown,
    F_nvmlErrorString,
    F_nvmlSystemGetDriverVersion,
    F_nvmlSystemGetCudaDriverVersion,
    F_nvmlSystemGetCudaDriverVersion_v2,
    F_nvmlDeviceGetCount_v2,
    F_nvmlDeviceGetHandleByIndex_v2,
    F_nvmlDeviceGetIndex,
    F_nvmlDeviceGetUUID,
    F_nvmlDeviceGetName,
    F_nvmlDeviceGetPciInfo_v3,
    F_nvmlDeviceGetMemoryInfo,
    F_nvmlDeviceGetMemoryInfo_v2,
    F_nvmlDeviceGetUtilizationRates,
    F_nvmlDeviceGetPowerUsage,
    F_nvmlDeviceGetEnforcedPowerLimit,
    F_nvmlDeviceGetPowerManagementLimit,
    F_nvmlDeviceGetTotalEnergyConsumption,
    F_nvmlDeviceGetTemperature,
    F_nvmlDeviceGetFanSpeed,
    F_nvmlDeviceGetClockInfo,
    F_nvmlDeviceGetComputeRunningProcesses_v3,
    F_nvmlDeviceGetGraphicsRunningProcesses_v3,
    F_nvmlDeviceGetEncoderUtilization,
    F_nvmlDeviceGetDecoderUtilization,
    F_nvmlDeviceGetPcieThroughput,
    F_COUNT
};

static const char *const function_names[F_COUNT] = {
    "nvmlInitWithFlags",
    "nvmlInit_v2",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetPcieThroughput",
};

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
