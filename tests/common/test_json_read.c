/* Unit test of the metrics.jsonl line reader (dg_json_read.h): a real step line, a string field with
 * escapes, and a line cut mid-write (a run killed while logging) that must be rejected, not misread. */
#include "dg_json_read.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

#define CHECK(c)                                                                                             \
    do {                                                                                                     \
        if (!(c)) {                                                                                          \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #c);                                     \
            return 1;                                                                                        \
        }                                                                                                    \
    } while (0)

int main(void) {
    dg_jl_obj o;
    const char *ok = "{\"event\":\"step\",\"step\":12,\"loss\":3.25,\"lr\":1e-4,\"ok\":true,\"x\":null}\n";
    CHECK(dg_jl_parse(ok, &o) == 0);
    CHECK(o.n == 6);
    CHECK(dg_jl_get(&o, "event")->is_str && !strcmp(dg_jl_get(&o, "event")->str, "step"));
    CHECK(dg_jl_get(&o, "step")->num == 12);
    CHECK(fabs(dg_jl_get(&o, "lr")->num - 1e-4) < 1e-12);
    CHECK(isnan(dg_jl_get(&o, "x")->num));
    CHECK(dg_jl_get(&o, "missing") == NULL);
    CHECK(dg_jl_parse("{\"msg\":\"a\\\"b\\n\\u0041\"}", &o) == 0);
    CHECK(!strcmp(dg_jl_get(&o, "msg")->str, "a\"b\nA"));
    /* every prefix of a valid line (a truncated write) is rejected */
    size_t n = strlen(ok) - 1; /* without the newline the full line is still valid */
    for (size_t cut = 0; cut + 1 < n; cut++) {
        char buf[256];
        memcpy(buf, ok, cut);
        buf[cut] = '\0';
        CHECK(dg_jl_parse(buf, &o) == -1);
    }
    CHECK(dg_jl_parse("{\"a\":1} trailing", &o) == -1);
    CHECK(dg_jl_parse("{\"a\":[1]}", &o) == -1);
    puts("ok");
    return 0;
}
