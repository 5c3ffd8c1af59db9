/* llama.cpp's own embedding of each text argument, one at a time, the plainest way: the text
 * tokenized with its special tokens, decoded as one sequence with every token an output, the
 * pooled vector the model's GGUF names read back (llama_get_embeddings_seq), L2-normalized.
 * The reference for tests/test_embeddings.py: none of llmsession's code is on this path.
 * Usage: embed_reference MODEL TEXT...  (prints one line of floats a text) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s MODEL TEXT...\n", argv[0]); return 2; }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_embd = llama_model_n_embd_out(model); /* (a pooled vector's width) */
    for (int a = 2; a < argc; a++) {
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 512;
        cp.embeddings = true;
        cp.n_threads = cp.n_threads_batch = 1;
        struct llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
        llama_token tokens[512];
        const int n = llama_tokenize(vocab, argv[a], (int) strlen(argv[a]), tokens, 512, true, true);
        if (n <= 0) { fprintf(stderr, "cannot tokenize\n"); return 1; }
        struct llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            batch.token[i] = tokens[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = n;
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        const float * v = llama_get_embeddings_seq(ctx, 0);
        if (!v) { fprintf(stderr, "no pooled embedding\n"); return 1; }
        double norm = 0.0;
        for (int i = 0; i < n_embd; i++) norm += (double) v[i] * v[i];
        norm = sqrt(norm);
        for (int i = 0; i < n_embd; i++) printf(i ? " %.9g" : "%.9g", norm > 0 ? v[i] / norm : v[i]);
        printf("\n");
        llama_batch_free(batch);
        llama_free(ctx);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
