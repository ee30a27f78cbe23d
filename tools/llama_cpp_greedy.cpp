// Greedy decoding with llama.cpp from token ids, printing token ids: the bench checks that a GGUF
// conversion computes what transformers does on the same prompt ids, with no tokenizer in between.
//
//     llama-greedy-ids -m model.gguf -n 16 12,7,99,3
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

static void set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

int main(int argc, char ** argv) {
    std::string model_path;
    int n_predict = 16;
    int n_threads = 0;
    std::vector<llama_token> prompt;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-m") == 0 && i + 1 < argc) {
            model_path = argv[++i];
        } else if (strcmp(argv[i], "-n") == 0 && i + 1 < argc) {
            n_predict = atoi(argv[++i]);
        } else if (strcmp(argv[i], "-t") == 0 && i + 1 < argc) {
            n_threads = atoi(argv[++i]);
        } else {
            std::stringstream ids(argv[i]);
            for (std::string id; std::getline(ids, id, ',');) {
                prompt.push_back((llama_token) atoi(id.c_str()));
            }
        }
    }
    if (model_path.empty() || prompt.empty() || n_predict < 1) {
        fprintf(stderr, "usage: %s -m model.gguf [-n n_predict] [-t threads] id,id,...\n", argv[0]);
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
    if (model == nullptr) {
        fprintf(stderr, "error: unable to load %s\n", model_path.c_str());
        return 1;
    }
    llama_context_params ctx_params = llama_context_default_params();
    ctx_params.n_ctx = prompt.size() + n_predict;
    ctx_params.n_batch = prompt.size();
    // float32 keys and values (llama.cpp's default is f16): the check compares float32 arithmetic.
    ctx_params.type_k = GGML_TYPE_F32;
    ctx_params.type_v = GGML_TYPE_F32;
    if (n_threads > 0) {
        ctx_params.n_threads = n_threads;
        ctx_params.n_threads_batch = n_threads;
    }
    llama_context * ctx = llama_init_from_model(model, ctx_params);
    if (ctx == nullptr) {
        fprintf(stderr, "error: unable to create a context for %s\n", model_path.c_str());
        return 1;
    }
    llama_sampler * greedy = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(greedy, llama_sampler_init_greedy());
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    set_tokens(batch, prompt.data(), prompt.size(), 0);
    llama_pos n_pos = prompt.size();
    for (int step = 0; step < n_predict; ++step) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
            fprintf(stderr, "error: decode failed at step %d\n", step);
            return 1;
        }
        llama_token next = llama_sampler_sample(greedy, ctx, -1);
        printf(step ? ",%d" : "%d", next);
        set_tokens(batch, &next, 1, n_pos++);
    }
    printf("\n");
    llama_batch_ext_free(batch);
    llama_sampler_free(greedy);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
