/* test_configs.c — every shipped configs/NAME.ini file must load and validate with the current schema (a
 * renamed or removed key would otherwise break the examples users copy). Usage: test_configs FILE... */
#include <stdio.h>
#include <stdlib.h>

#include "config.h"

int main(int argc, char **argv) {
    int bad = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s CONFIG.ini...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        dg_config_t *c = calloc(1, sizeof *c);
        dg_status_t s = dg_config_load(c, argv[i], 0, NULL);
        if (s != DG_OK) {
            fprintf(stderr, "FAIL %s: %s\n", argv[i], dg_last_error());
            bad = 1;
        } else {
            printf("ok %s\n", argv[i]);
        }
        free(c);
    }
    return bad;
}
