/* dg_sample.h — `dgtrain sample CKPT_OR_RUN_DIR --prompt TEXT ...` (issue 22.4): text generation from a
 * checkpoint with the KV-cache decoder (dg_infer.h) and the sampler (dg_sampler.h). Flags, figures and
 * exit codes: docs/sampling.md.
 */
#ifndef DG_SAMPLE_H
#define DG_SAMPLE_H

#ifdef __cplusplus
extern "C" {
#endif

/* argv[0] is "sample" (the subcommand), the rest its flags. Starts and ends MPI itself (one process,
 * MPI_COMM_SELF, for the checkpoint reader). Returns the exit code: 0 done, 2 bad input (flag values,
 * no checkpoint, a prompt longer than seq_len, an unknown tokenizer) or a failure, with one line on
 * stderr ("dgtrain sample: error: ..."). */
int dg_sample_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif /* DG_SAMPLE_H */
