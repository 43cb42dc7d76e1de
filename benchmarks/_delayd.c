/* A one-way delay for every packet a network namespace sends, where the kernel has no sch_netem.
 *
 *     iptables-legacy -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass
 *     _delayd 0 500        # queue 0, hold every packet 500 us, then accept it
 *
 * benchmarks/_netns.py builds and starts one per emulated machine (gcc, no library: raw nfnetlink).
 * The kernel keeps each packet (a whole GSO segment: NFQA_CFG_F_GSO) and sends us only its metadata
 * (NFQNL_COPY_META); we note its id and arrival time and, once the oldest packets are DELAY old, accept
 * every packet up to the newest due one with one batch verdict (ids grow in queue order and the delay
 * is the same for all, so due packets are always a prefix). No payload is copied: the cost is one
 * netlink message per packet. SCHED_FIFO (when allowed) keeps the wake-up on time while the
 * machine's cores are busy with training. FAIL_OPEN: a full queue accepts instead of dropping.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RING (1u << 18)

static int fd;
static uint32_t seq;
static uint16_t queue;
static uint32_t ids[RING];
static int64_t at[RING];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static char *put_attr(char *p, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *a = (struct nlattr *)p;
    a->nla_type = type;
    a->nla_len = NLA_HDRLEN + len;
    memcpy(p + NLA_HDRLEN, data, len);
    memset(p + NLA_HDRLEN + len, 0, NLA_ALIGN(len) - len);
    return p + NLA_HDRLEN + NLA_ALIGN(len);
}

static char *start_msg(char *buf, uint16_t msgtype, uint16_t flags, uint8_t family) {
    struct nlmsghdr *h = (struct nlmsghdr *)buf;
    memset(buf, 0, NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg)));
    h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | msgtype;
    h->nlmsg_flags = NLM_F_REQUEST | flags;
    h->nlmsg_seq = ++seq;
    struct nfgenmsg *g = (struct nfgenmsg *)(buf + NLMSG_HDRLEN);
    g->nfgen_family = family;
    g->version = NFNETLINK_V0;
    g->res_id = htons(queue);
    return buf + NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

static void send_msg(char *buf, char *end) {
    ((struct nlmsghdr *)buf)->nlmsg_len = (uint32_t)(end - buf);
    struct sockaddr_nl k = {.nl_family = AF_NETLINK};
    if (sendto(fd, buf, end - buf, 0, (struct sockaddr *)&k, sizeof k) < 0) {
        perror("_delayd: sendto");
        exit(1);
    }
}

static void configure(void) {
    char buf[256], *p;
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND, .pf = htons(AF_INET)};
    p = start_msg(buf, NFQNL_MSG_CONFIG, 0, AF_UNSPEC);
    p = put_attr(p, NFQA_CFG_CMD, &cmd, sizeof cmd);
    send_msg(buf, p);
    struct nfqnl_msg_config_params par = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
    uint32_t maxlen = htonl(RING / 2), flags = htonl(NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN);
    p = start_msg(buf, NFQNL_MSG_CONFIG, 0, AF_UNSPEC);
    p = put_attr(p, NFQA_CFG_PARAMS, &par, sizeof par);
    p = put_attr(p, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen);
    p = put_attr(p, NFQA_CFG_FLAGS, &flags, sizeof flags);
    p = put_attr(p, NFQA_CFG_MASK, &flags, sizeof flags);
    send_msg(buf, p);
}

static void accept_upto(uint32_t id) {
    char buf[128], *p;
    struct nfqnl_msg_verdict_hdr v = {.verdict = htonl(NF_ACCEPT), .id = htonl(id)};
    p = start_msg(buf, NFQNL_MSG_VERDICT_BATCH, 0, AF_UNSPEC);
    p = put_attr(p, NFQA_VERDICT_HDR, &v, sizeof v);
    send_msg(buf, p);
}

/* Parse every message in buf; note each packet's id. */
static void take(char *buf, ssize_t n, uint32_t *head, int64_t t) {
    for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
        if (h->nlmsg_type == NLMSG_ERROR) {
            struct nlmsgerr *e = (struct nlmsgerr *)NLMSG_DATA(h);
            if (e->error) fprintf(stderr, "_delayd: netlink error %d\n", e->error);
            continue;
        }
        if ((h->nlmsg_type & 0xff) != NFQNL_MSG_PACKET) continue;
        char *a = (char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
        char *end = (char *)h + h->nlmsg_len;
        while (a + NLA_HDRLEN <= end) {
            struct nlattr *na = (struct nlattr *)a;
            if (na->nla_len < NLA_HDRLEN) break;
            if ((na->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
                struct nfqnl_msg_packet_hdr *ph = (struct nfqnl_msg_packet_hdr *)(a + NLA_HDRLEN);
                ids[*head % RING] = ntohl(ph->packet_id);
                at[*head % RING] = t;
                ++*head;
                break;
            }
            a += NLA_ALIGN(na->nla_len);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: _delayd QUEUE DELAY_US\n");
        return 2;
    }
    queue = (uint16_t)atoi(argv[1]);
    int64_t delay = (int64_t)atoll(argv[2]) * 1000;
    struct sched_param sp = {.sched_priority = 10};
    if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0) perror("_delayd: SCHED_FIFO (continuing)");
    fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (fd < 0) { perror("_delayd: socket"); return 1; }
    int rcv = 16 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcv, sizeof rcv);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl me = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&me, sizeof me) < 0) { perror("_delayd: bind"); return 1; }
    configure();
    fprintf(stderr, "_delayd: queue %u, %lld us\n", queue, (long long)(delay / 1000));
    static char buf[1 << 17];
    uint32_t head = 0, tail = 0;
    for (;;) {
        int64_t t = now_ns();
        int have = 0;
        uint32_t upto = 0;
        while (tail != head && at[tail % RING] + delay <= t) {
            upto = ids[tail % RING];
            have = 1;
            ++tail;
        }
        if (have) accept_upto(upto);
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        struct timespec ts = {1, 0};
        if (tail != head) {
            int64_t wait = at[tail % RING] + delay - now_ns();
            if (wait < 0) wait = 0;
            ts.tv_sec = wait / 1000000000LL;
            ts.tv_nsec = wait % 1000000000LL;
        }
        if (ppoll(&pfd, 1, &ts, NULL) > 0) {
            for (;;) {
                ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
                if (n < 0) {
                    if (errno != EAGAIN && errno != EINTR && errno != ENOBUFS) { perror("_delayd: recv"); return 1; }
                    break;
                }
                take(buf, n, &head, now_ns());
                if (head - tail >= RING) { fprintf(stderr, "_delayd: ring full\n"); return 1; }
            }
        }
    }
}
