# Cython view of the C headers (cuda/include/dfccl): abi.h, the layouts shared by the host
# runtime, the daemon kernel and the simulator; the host atomics, hashes and
# the C API (dfccl_api.h).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t

cdef extern from "dfccl/abi.h":
    int DFCCL_ABI_VERSION
    int DFCCL_MAX_CHANNELS
    int DFCCL_MAX_RANKS
    int DFCCL_PEER_CACHE

    int DFCCL_ALL_REDUCE, DFCCL_ALL_GATHER, DFCCL_REDUCE_SCATTER, DFCCL_BROADCAST, DFCCL_REDUCE
    int DFCCL_SEND, DFCCL_RECV, DFCCL_ALL_TO_ALL
    int DFCCL_PATH_DIRECT, DFCCL_PATH_RING
    int DFCCL_STATUS_OK, DFCCL_STATUS_MISMATCH, DFCCL_STATUS_PEER_ABORTED, DFCCL_STATUS_ABORTED, DFCCL_STATUS_BAD_TASK
    int DFCCL_STATUS_PEER_LOST
    int DFCCL_NUM_KINDS, DFCCL_NUM_DTYPES, DFCCL_NUM_OPS, DFCCL_NUM_PATHS
    unsigned int DFCCL_EP_ABORTED, DFCCL_EP_PEER_LOST
    unsigned int DFCCL_ARENA_STATUS_BYTES, DFCCL_RANK_LIVE, DFCCL_RANK_ABORTED, DFCCL_RANK_CLOSED
    unsigned int DFCCL_RANK_FAILED
    unsigned int DFCCL_TASK_ONE_SHOT, DFCCL_TASK_ARMED, DFCCL_TASK_STAGED, DFCCL_TASK_LL, DFCCL_TASK_KEY_BUCKET
    unsigned int DFCCL_TASK_GRAPH, DFCCL_TASK_FOLLOWS, DFCCL_GRAPH_GEN_BIT
    unsigned int DFCCL_DAEMON_RUNNING, DFCCL_DAEMON_QUITTING, DFCCL_DAEMON_EXITED, DFCCL_DAEMON_LEAVING
    unsigned int DFCCL_DAEMON_EPOCH_SHIFT, DFCCL_DAEMON_STATE_MASK
    unsigned int DFCCL_RECORD_HEADER_BYTES
    unsigned int DFCCL_RECORD_BYTES
    unsigned int DFCCL_OWNER_BUCKET_BYTES
    unsigned int DFCCL_LINK_AHEAD_MAX
    int DFCCL_INT8, DFCCL_UINT8, DFCCL_INT32, DFCCL_UINT32, DFCCL_INT64, DFCCL_UINT64
    int DFCCL_FLOAT16, DFCCL_FLOAT32, DFCCL_FLOAT64, DFCCL_BFLOAT16
    int DFCCL_SUM, DFCCL_PROD, DFCCL_MIN, DFCCL_MAX, DFCCL_AVG
    unsigned int DFCCL_TASK_SEND_REGISTERED, DFCCL_REG_SLOTS, DFCCL_REG_SLOT_SHIFT
    uint64_t DFCCL_REG_BIT
    unsigned int DFCCL_FIFO_UNIT_SHIFT, DFCCL_FIFO_UNIT_BYTES, DFCCL_FIFO_UNIT_MAX, DFCCL_FIFO_SLOTS_SHIFT
    unsigned int DFCCL_FIFO_SLOTS_MAX
    unsigned long long DFCCL_FIFO_OFFSET_MASK, DFCCL_FIFO_NO_STAGE

    ctypedef struct dfccl_task_desc:
        uint64_t send_addr
        uint64_t recv_addr
        uint64_t count
        uint64_t tag_key
        uint64_t instance
        uint64_t send_reg
        uint64_t aux_offset
        uint64_t after
        uint64_t fifo_offset
        uint32_t endpoint
        uint32_t bucket
        uint32_t slot
        uint32_t gen
        uint32_t slice_bytes
        uint32_t fifo_slots
        uint32_t flags
        uint16_t root
        uint16_t nchannels
        uint8_t kind
        uint8_t dtype
        uint8_t op
        uint8_t path
        uint32_t first_block

    ctypedef struct dfccl_sqe:
        dfccl_task_desc desc
        uint64_t seq
        uint64_t check

    ctypedef struct dfccl_graph_arm:
        dfccl_task_desc desc
        uint64_t binding

    ctypedef struct dfccl_control:
        uint64_t sq_tail
        uint64_t base_window_ns
        uint64_t max_window_ns
        uint64_t idle_quit_ns
        uint64_t quit_request
        uint64_t abort_epoch
        uint64_t stream_waits
        uint64_t daemon_state
        uint64_t sq_copied
        uint64_t graph_arms
        uint64_t graph_failed

    ctypedef struct dfccl_result:
        uint32_t status
        int32_t detail
        uint32_t preemptions
        uint32_t resumes
        uint64_t queued_ns
        uint64_t running_ns
        uint64_t wall_ns
        uint32_t waiting_on
        uint32_t nchannels
        uint64_t max_wait_ns

    ctypedef struct dfccl_task_ctx:
        pass

    ctypedef struct dfccl_block_profile:
        uint64_t passes
        uint64_t runs
        uint64_t pull_ns
        uint64_t pick_ns
        uint64_t restore_ns
        uint64_t run_ns
        uint64_t save_ns
        uint64_t idle_ns

    ctypedef struct dfccl_step_profile:
        uint64_t ll_runs
        uint64_t ll_credit_ns
        uint64_t ll_push_ns
        uint64_t ll_recv_ns
        uint64_t ll_finish_ns
        uint64_t complete_ns
        uint64_t ll_publish_ns
        uint64_t ll_move_ns

    ctypedef struct dfccl_daemon_state:
        uint64_t base_window_ns
        uint64_t max_window_ns
        uint64_t idle_quit_ns
        uint64_t bad_tasks
        dfccl_block_profile profile[32]
        dfccl_step_profile steps[32]
        uint32_t block_sm[32]

    ctypedef struct dfccl_chan_state:
        uint64_t ready
        uint64_t instance

    ctypedef struct dfccl_rank_status:
        uint64_t state
        uint64_t heartbeat
        uint64_t pid

    ctypedef struct dfccl_endpoint:
        uint32_t rank
        uint32_t nranks
        uint32_t table_capacity
        uint32_t record_stride
        uint64_t comm_key
        uint64_t reg_table
        uint64_t ll_offset
        uint32_t ll_max_bytes
        uint64_t net_remote
        uint64_t net_queues
        uint64_t peer_table[64]
        uint64_t peer_arena[64]
        uint64_t owner_words

    ctypedef struct dfccl_daemon_args:
        dfccl_control *control
        dfccl_sqe *ring
        dfccl_task_desc *dev_ring
        uint32_t *armed
        uint32_t *done
        dfccl_result *results
        dfccl_daemon_state *state
        dfccl_task_ctx *ctx
        uint32_t *active
        uint32_t *slot_counter
        uint32_t *slot_error
        uint32_t *slot_waiting
        dfccl_endpoint *endpoints
        uint32_t *endpoint_abort
        uint32_t *endpoint_abort_dev
        uint32_t ring_size
        uint32_t nslots
        uint32_t nblocks
        uint32_t epoch
        uint32_t max_endpoints
        uint32_t link_ahead
        uint32_t link_block
        uint64_t empty_quit_ns
        dfccl_task_desc *graph_desc
        uint64_t *graph_count
        uint32_t *graph_mask


cdef extern from "dfccl/host_atomics.h":
    uint64_t dfccl_load_acquire_u64(const uint64_t *p) nogil
    uint32_t dfccl_load_acquire_u32(const uint32_t *p) nogil
    void dfccl_store_release_u64(uint64_t *p, uint64_t v) nogil
    void dfccl_store_release_u32(uint32_t *p, uint32_t v) nogil
    uint32_t dfccl_exchange_u32(uint32_t *p, uint32_t v) nogil
    uint32_t dfccl_add_fetch_u32(uint32_t *p, int32_t v) nogil
    void dfccl_fence_seq_cst() nogil
    void dfccl_cpu_relax() nogil
    void dfccl_sleep_ns(uint64_t ns) nogil
    void dfccl_yield() nogil
    void dfccl_wait_pause(uint64_t waited_ns) nogil
    uint64_t dfccl_now_ns() nogil


cdef extern from "dfccl/hash.h":
    uint64_t dfccl_mix64(uint64_t x) nogil
    uint64_t dfccl_instance_token(uint64_t key, uint64_t instance) nogil
    uint32_t dfccl_home_bucket(uint64_t key, uint32_t capacity) nogil
    uint32_t dfccl_first_block(uint64_t key, uint32_t offset, uint32_t nblocks) nogil
    uint64_t dfccl_sqe_check(const uint64_t *desc_words, uint64_t seq) nogil
    uint64_t dfccl_graph_key(uint64_t key, uint64_t n) nogil


cdef extern from "dfccl/layout.h":
    unsigned int DFCCL_STAGE_ALIGN, DFCCL_LL_HEADER_LINES, DFCCL_LL_LINE_BYTES, DFCCL_LL_LINE_PAYLOAD
    unsigned int DFCCL_LL_MAX_RANKS, DFCCL_LL_DEFAULT_MAX_BYTES
    uint32_t dfccl_dtype_size(int dtype) nogil
    uint64_t dfccl_ll_area_bytes(uint64_t ll_max_bytes) nogil
    uint64_t dfccl_ll_region_bytes(uint32_t capacity, uint32_t nranks, uint64_t ll_max_bytes) nogil
    uint64_t dfccl_a2a_words(uint32_t nranks, uint32_t nchannels) nogil
    uint64_t dfccl_a2a_copy_offset(uint32_t nranks, uint32_t nchannels) nogil


cdef extern from "dfccl/dfccl_api.h":
    unsigned int DFCCL_API_VERSION
    const char *DFCCL_API_CAPSULE
    int DFCCL_API_OK, DFCCL_API_PENDING, DFCCL_API_FAILED
    int DFCCL_API_E_INVALID, DFCCL_API_E_RESOURCE, DFCCL_API_E_CLOSED, DFCCL_API_E_BACKEND, DFCCL_API_E_PYTHON

    ctypedef struct dfccl_plan:
        pass

    ctypedef struct dfccl_handle:
        void *context
        uint32_t slot
        uint32_t gen

    ctypedef struct dfccl_submit_at:
        uint64_t send_addr
        uint64_t recv_addr
        uint64_t stream
        uint32_t has_stream

    ctypedef struct dfccl_api:
        size_t size
        uint32_t version
        int (*submit)(const dfccl_plan *plan, const dfccl_submit_at *at, dfccl_handle *out) noexcept nogil
        int (*test)(const dfccl_handle *h, uint32_t *status, int32_t *detail) noexcept nogil
        int (*wait)(const dfccl_handle *h, int64_t timeout_ns, uint32_t *status, int32_t *detail) noexcept nogil
        int (*stream_wait)(const dfccl_handle *h, uint64_t stream) noexcept nogil
        int (*release)(dfccl_handle *h) noexcept nogil
        const char *(*error_string)(int code) noexcept nogil
        const char *(*last_error)() noexcept nogil
        int (*plan_retain)(const dfccl_plan *plan) noexcept nogil
        int (*plan_release)(const dfccl_plan *plan) noexcept nogil
