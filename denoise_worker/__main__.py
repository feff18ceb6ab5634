from common.runtime.worker import main
from denoise_worker.stage import DenoiseStage

if __name__ == "__main__":
    main(DenoiseStage)
